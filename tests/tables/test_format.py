# SPDX-License-Identifier: Apache-2.0
"""The .ibpt file: bit-exact round trips, the C++ header layout, and every kind of bad file."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpembed import FitOptions, compress
from ibpembed.tables import format as tf
from ibpembed.tables import writer as tw
from tests.codec.tables import DIMS, DTYPES, KINDS, make_table
from tests.tables.helpers import (
    flip_bit,
    reseal_section,
    same_bits,
    section_ranges,
    trained_like,
)

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("header", "section table", *(k.label for k in tf.SectionKind))


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    weight = trained_like(300, 24)
    path = tmp_path / "t.ibpt"
    tw.pack_table(path, weight, name="t")
    return path, weight


# -- round trips -----------------------------------------------------------------------------


@settings(max_examples=25)
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 200),
    dim=st.sampled_from(DIMS),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
    step_rows=st.sampled_from([32, 64, 1 << 20]),
)
def test_pack_read_roundtrip_is_bit_exact(
    tmp_path_factory, dtype, rows, dim, kind, seed, step_rows
) -> None:
    weight = make_table(dtype, rows, dim, kind, seed)
    path = tmp_path_factory.mktemp("rt") / "t.ibpt"
    # Small steps exercise the streaming writer's block stitching.
    original = tw.PACK_STEP_BYTES
    tw.PACK_STEP_BYTES = step_rows * weight.shape[1] * dtype.itemsize
    try:
        info = tw.pack_table(path, weight, name="t")
    finally:
        tw.PACK_STEP_BYTES = original
    loaded = tf.read_table(path, verify=True)
    assert same_bits(loaded.table.decompress(), weight)
    # The streamed file holds exactly what the in-memory codec produces.
    reference = compress(weight)
    for field in ("payload", "block_base", "row_units", "bitmask", "mask", "bitval"):
        assert torch.equal(getattr(loaded.table, field), getattr(reference, field)), field
    assert info.payload_bytes == reference.payload_bytes
    assert info.stored_bytes == reference.stored_bytes
    tf.verify_file(path)


def test_payload_is_zero_copy_over_the_mapping(packed) -> None:
    path, _ = packed
    table = tf.read_table(path).table
    # Writes land in the private mapping only; the file itself never changes.
    before = path.read_bytes()
    table.payload[0] ^= 0xFF
    assert path.read_bytes() == before
    payload = next(s for s in tf.read_table(path).sections if s.kind is tf.SectionKind.PAYLOAD)
    assert payload.offset % tf.PAYLOAD_ALIGN == 0


def test_int8_rowwise_quant_survives_the_file(tmp_path: Path) -> None:
    rows = torch.randint(0, 256, (100, 12), dtype=torch.uint8)
    rows[:, :4] = torch.tensor([0.01, 0.5], dtype=torch.float16).view(torch.uint8)
    tw.pack_table(tmp_path / "q.ibpt", rows, name="q", fit=FitOptions(quant="int8_rowwise"))
    table = tf.read_table(tmp_path / "q.ibpt").table
    assert table.quant == "int8_rowwise"
    expected = compress(rows, quant="int8_rowwise")
    ids = torch.tensor([0, 5, 99])
    assert torch.equal(
        table.lookup(ids, lengths=torch.tensor([3])),
        expected.lookup(ids, lengths=torch.tensor([3])),
    )


def test_write_table_of_a_compressed_table_matches_pack(tmp_path: Path) -> None:
    weight = trained_like(257, 16, torch.bfloat16)
    tw.pack_table(tmp_path / "a.ibpt", weight, name="t", fit=FitOptions(sample_rows=None))
    meta = {
        k: v
        for k, v in tf.read_table(tmp_path / "a.ibpt").meta.items()
        if k not in ("name", "quant", "source_xxh3")
    }
    tw.write_table(tmp_path / "b.ibpt", compress(weight, sample_rows=None), name="t", meta=meta)
    assert (tmp_path / "a.ibpt").read_bytes() == (tmp_path / "b.ibpt").read_bytes()


def test_writer_replaces_atomically_and_leaves_no_temporaries(packed) -> None:
    path, _ = packed
    new = trained_like(40, 8, seed=3)
    tw.pack_table(path, new, name="t")
    assert same_bits(tf.read_table(path).table.decompress(), new)
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_failed_write_keeps_the_old_file(packed) -> None:
    path, weight = packed
    with pytest.raises(TypeError):
        tw.pack_table(path, torch.zeros(4, 4, dtype=torch.float64), name="t")
    assert same_bits(tf.read_table(path, verify=True).table.decompress(), weight)
    assert [p.name for p in path.parent.iterdir()] == [path.name]


# -- the C++ header and the Python structs agree ------------------------------------------------

_PROBE = r"""
#include <cstdio>
#include "ibpembed/table_file.h"
using namespace ibpembed;
#define OFF(T, f) std::printf(#T "." #f " %zu\n", offsetof(T, f))
int main() {
  std::printf("FileHeader %zu\nSectionEntry %zu\nversion %u\nmagic %.8s\n", sizeof(FileHeader),
              sizeof(SectionEntry), kTableFileVersion, kTableFileMagic);
  std::printf("align %llu %llu\n", (unsigned long long)kSectionAlign,
              (unsigned long long)kPayloadAlign);
  OFF(FileHeader, magic); OFF(FileHeader, version); OFF(FileHeader, header_bytes);
  OFF(FileHeader, section_count); OFF(FileHeader, section_entry_bytes);
  OFF(FileHeader, file_bytes); OFF(FileHeader, num_rows); OFF(FileHeader, dim);
  OFF(FileHeader, row_bytes); OFF(FileHeader, unit_bytes); OFF(FileHeader, dtype);
  OFF(FileHeader, chunk_bits); OFF(FileHeader, num_chunks); OFF(FileHeader, layout_version);
  OFF(FileHeader, sections_xxh3); OFF(FileHeader, code_bits); OFF(FileHeader, reserved);
  OFF(FileHeader, header_xxh3);
  OFF(SectionEntry, kind); OFF(SectionEntry, flags); OFF(SectionEntry, offset);
  OFF(SectionEntry, length); OFF(SectionEntry, xxh3);
  std::printf("kinds %u %u %u %u %u %u %u\n", (unsigned)SectionKind::kMask,
              (unsigned)SectionKind::kBitval, (unsigned)SectionKind::kBlockBase,
              (unsigned)SectionKind::kRowUnits, (unsigned)SectionKind::kBitmask,
              (unsigned)SectionKind::kPayload, (unsigned)SectionKind::kMeta);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile table_file.h")
def test_cpp_header_matches_python_structs(tmp_path: Path) -> None:
    source = tmp_path / "probe.cpp"
    source.write_text(_PROBE)
    binary = tmp_path / "probe"
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-Wall",
            "-Werror",
            "-I",
            str(REPO / "csrc/include"),
            str(source),
            "-o",
            str(binary),
        ],
        check=True,
    )
    out = dict(
        line.rsplit(" ", 1)
        for line in subprocess.check_output([binary], text=True).splitlines()
        if not line.startswith(("align", "kinds"))
    )
    lines = subprocess.check_output([binary], text=True).splitlines()
    assert int(out["FileHeader"]) == tf.HEADER.size
    assert int(out["SectionEntry"]) == tf.SECTION.size
    assert int(out["version"]) == tf.VERSION
    assert out["magic"] == tf.MAGIC.decode()
    assert next(line for line in lines if line.startswith("align")).split()[1:] == [
        str(tf.SECTION_ALIGN),
        str(tf.PAYLOAD_ALIGN),
    ]
    kinds = next(line for line in lines if line.startswith("kinds")).split()[1:]
    assert [int(k) for k in kinds] == [int(k) for k in tf.SectionKind]
    # Offsets of the Python struct, field by field (struct.calcsize of each prefix).
    header_fields = [
        "magic",
        "version",
        "header_bytes",
        "section_count",
        "section_entry_bytes",
        "file_bytes",
        "num_rows",
        "dim",
        "row_bytes",
        "unit_bytes",
        "dtype",
        "chunk_bits",
        "num_chunks",
        "layout_version",
        "sections_xxh3",
        "code_bits",
        "reserved",
        "header_xxh3",
    ]
    codes = [
        *("8s", "I", "I", "I", "I", "Q", "q", "q", "q", "q", "i", "i", "I", "I", "Q", "I", "28s"),
        "Q",
    ]
    assert "<" + "".join(codes) == tf.HEADER.format
    for i, name in enumerate(header_fields):
        assert int(out[f"FileHeader.{name}"]) == struct.calcsize("<" + "".join(codes[:i])), name
    entry_codes = {"kind": "", "flags": "I", "offset": "II", "length": "IIQ", "xxh3": "IIQQ"}
    for name, prefix in entry_codes.items():
        assert int(out[f"SectionEntry.{name}"]) == struct.calcsize("<" + prefix), name


# -- golden files: format changes must be deliberate ----------------------------------------
#
# data/golden_layout<N>.ibpt is the golden table packed by the build whose compact layout
# (kFormatVersion in format.h) is N. A layout change must bump kFormatVersion and add a golden
# file for the new version: `python -m tests.tables.test_format` from the repository root (see
# the end of this file). Older golden files stay, to prove that files in a layout this build
# cannot decode are refused.

GOLDEN_DIR = Path(__file__).parent / "data"
GOLDEN = GOLDEN_DIR / f"golden_layout{tf.LAYOUT_VERSION}.ibpt"
# The same table with 3-bit codebooks on 32-bit chunks (layout 3's exponent-aware mode).
GOLDEN_CODED = GOLDEN_DIR / f"golden_layout{tf.LAYOUT_VERSION}_c3.ibpt"
# Layout 2 is layout 3 with one-pattern codebooks, in file version 1: still read.
GOLDEN_READABLE_OLDER = (GOLDEN_DIR / "golden_layout2.ibpt",)


def write_golden() -> None:
    """Pack the golden tables with this build (run once per new layout version)."""
    tw.pack_table(GOLDEN, golden_weight(), name="golden", fit=FitOptions(sample_rows=None))
    coded = FitOptions(sample_rows=None, chunk_bits=32, code_bits=3)
    tw.pack_table(GOLDEN_CODED, golden_weight(), name="golden", fit=coded)


def golden_weight() -> torch.Tensor:
    """70 x 5 float32 rows from integer arithmetic only (no RNG, no libm): exact everywhere."""
    i = torch.arange(70, dtype=torch.int64)[:, None]
    j = torch.arange(5, dtype=torch.int64)[None, :]
    return (((i * 7 + j * 13) % 97).to(torch.float32) / 64.0 - 0.5).contiguous()


@pytest.mark.parametrize("path", [GOLDEN, GOLDEN_CODED, *GOLDEN_READABLE_OLDER], ids=str)
def test_golden_file_reads_to_the_known_rows(path: Path) -> None:
    assert path.exists(), f"no golden file {path.name}: see write_golden"
    loaded = tf.read_table(path, verify=True)
    assert loaded.name == "golden"
    assert same_bits(loaded.table.decompress(), golden_weight())
    tf.verify_file(path)


def test_golden_coded_file_uses_codebooks() -> None:
    header = tf.read_table(GOLDEN_CODED).header
    assert (header.code_bits, header.chunk_bits, header.version) == (3, 32, tf.VERSION)


def test_files_in_other_layouts_are_refused() -> None:
    known = {GOLDEN, GOLDEN_CODED, *GOLDEN_READABLE_OLDER}
    others = [p for p in GOLDEN_DIR.glob("golden_layout*.ibpt") if p not in known]
    assert others or tf.LAYOUT_VERSION == 1  # every earlier layout keeps its golden file
    for path in others:
        with pytest.raises(tf.TableFileError, match=r"compact layout version \d+, .* repack"):
            tf.read_table(path)


@pytest.mark.parametrize("path", [GOLDEN, GOLDEN_CODED], ids=str)
def test_writer_reproduces_the_golden_bytes(path: Path, tmp_path: Path) -> None:
    # Rewriting the golden table (same index, masks, meta) must give the same bytes: a change
    # here is a format change, which needs a new version and a new golden file.
    loaded = tf.read_table(path)
    extra = {k: v for k, v in loaded.meta.items() if k not in ("name", "quant", "source_xxh3")}
    tw.write_table(tmp_path / "g.ibpt", loaded.table, name="golden", meta=extra)
    assert (tmp_path / "g.ibpt").read_bytes() == path.read_bytes()


# -- bad files -------------------------------------------------------------------------------


def test_wrong_magic(packed) -> None:
    path, _ = packed
    data = bytearray(path.read_bytes())
    data[:8] = b"NOTIBPT!"
    path.write_bytes(bytes(data))
    with pytest.raises(tf.TableFileError, match="section 'header': not an ibpembed table") as e:
        tf.read_table(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("content", [b"", b"IBPT", b'{"json": true}\n'])
def test_foreign_and_tiny_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.ibpt"
    path.write_bytes(content)
    with pytest.raises(tf.TableFileError, match="header"):
        tf.read_table(path)


def test_unknown_version(packed) -> None:
    path, _ = packed
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", tf.VERSION + 1)
    path.write_bytes(bytes(data))
    with pytest.raises(tf.TableFileError, match=f"unknown file version {tf.VERSION + 1}"):
        tf.read_table(path)


@pytest.mark.parametrize("section", SECTIONS)
def test_bit_flip_in_each_section_names_it(packed, section: str) -> None:
    path, _ = packed
    begin, end = section_ranges(path)[section]
    # Skip the magic (its own error) and the version (an "unknown version" error).
    offset = 16 if section == "header" else (begin + end) // 2
    flip_bit(path, offset, 3)
    with pytest.raises(tf.TableFileError) as e:
        tf.read_table(path, verify=True)
    assert e.value.section == section
    assert str(path) in str(e.value)


def test_payload_flip_is_caught_by_verify_only(packed) -> None:
    path, _ = packed
    begin, _ = section_ranges(path)["payload"]
    flip_bit(path, begin + 5)
    tf.read_table(path)  # payload hashing is opt-in at load: it reads every byte
    with pytest.raises(tf.TableFileError, match="section 'payload': checksum mismatch"):
        tf.read_table(path, verify=True)
    with pytest.raises(tf.TableFileError, match="payload"):
        tf.verify_file(path)


@settings(max_examples=40)
@given(data=st.data())
def test_random_truncation_is_always_an_error(tmp_path_factory, data) -> None:
    directory = tmp_path_factory.mktemp("trunc")
    path = directory / "t.ibpt"
    tw.pack_table(path, trained_like(90, 6), name="t")
    full = path.read_bytes()
    cut = data.draw(st.integers(0, len(full) - 1))
    path.write_bytes(full[:cut])
    with pytest.raises(tf.TableFileError, match="header"):
        tf.read_table(path)


@settings(max_examples=60)
@given(data=st.data())
def test_random_byte_corruption_is_always_an_error(tmp_path_factory, data) -> None:
    directory = tmp_path_factory.mktemp("fuzz")
    path = directory / "t.ibpt"
    tw.pack_table(path, trained_like(90, 6), name="t")
    full = bytearray(path.read_bytes())
    offsets = data.draw(
        st.lists(st.integers(0, len(full) - 1), min_size=1, max_size=4, unique=True)
    )
    for offset in offsets:
        full[offset] ^= data.draw(st.integers(1, 255))
    path.write_bytes(bytes(full))
    with pytest.raises(tf.TableFileError):
        tf.verify_file(path)


def test_trailing_bytes_are_an_error(packed) -> None:
    path, _ = packed
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(tf.TableFileError, match="unexpected bytes after the end"):
        tf.read_table(path)


def test_pack_matches_compress_beyond_the_width_probe(tmp_path: Path) -> None:
    # Large enough that the codec chooses the chunk width on a sub-sample: pack must draw the
    # very same samples as compress.
    weight = trained_like(70_000, 8)
    tw.pack_table(tmp_path / "big.ibpt", weight, name="big")
    loaded = tf.read_table(tmp_path / "big.ibpt").table
    reference = compress(weight)
    assert loaded.chunk_bits == reference.chunk_bits
    assert torch.equal(loaded.mask, reference.mask)
    assert torch.equal(loaded.payload, reference.payload)


def _with_header_field(path: Path, offset: int, value: int) -> None:
    """Rewrite one uint32 header field and re-seal the header checksum (a well-formed lie)."""
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = struct.pack("<I", value)
    hashed = tf.HEADER.size - 8
    data[hashed : tf.HEADER.size] = struct.pack(
        "<Q", xxhash.xxh3_64_intdigest(bytes(data[:hashed]))
    )
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("layout", "code_bits"), [(3, 0), (3, 5), (2, 3)])
def test_code_width_must_suit_the_layout(packed, layout: int, code_bits: int) -> None:
    path, _ = packed
    _with_header_field(path, 76, layout)  # FileHeader.layout_version
    _with_header_field(path, 88, code_bits)  # FileHeader.code_bits
    with pytest.raises(tf.TableFileError, match=f"code width {code_bits} is invalid"):
        tf.read_table(path)


def test_slot_sizes_must_agree_with_the_compressed_bits(tmp_path: Path) -> None:
    # A well-sealed file (every checksum right) whose rows are marked raw while their slots keep
    # the compressed size: lookups would copy raw rows past their slots and off the mapping.
    path = tmp_path / "lie.ibpt"
    tw.pack_table(path, trained_like(64, 64), name="lie")
    bitmask = tf.read_table(path).table.bitmask
    assert bool(bitmask.ne(0).any())
    reseal_section(path, tf.SectionKind.BITMASK, bytes(bitmask.numel() * 4))  # every row "raw"
    with pytest.raises(tf.TableFileError, match="disagrees with its compressed bit") as e:
        tf.read_table(path, verify=True)
    assert e.value.section == "row_units"


def _resident_fraction(path: Path, offset: int, length: int) -> float:
    """The share of a file range's pages in the page cache (mincore over a fresh mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = offset - offset % page
    pages = (offset + length - start + page - 1) // page
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) + start
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(pages * page), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(v & 1 for v in vec) / pages
    finally:
        del address
        mapping.close()


def _drop_from_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def test_prefetch_reads_the_payload_into_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "big.ibpt"
    # 64 MiB: far more than one fault's readahead (the kernel reads up to read_ahead_kb, 8 MiB on
    # the development VM, around any page the loader touches).
    weight = torch.randn(262144, 64) * 0.05
    tw.pack_table(path, weight, name="big")
    payload = next(s for s in tf.read_table(path).sections if s.kind is tf.SectionKind.PAYLOAD)
    _drop_from_page_cache(path)
    if _resident_fraction(path, payload.offset, payload.length) > 0.1:
        pytest.skip("this filesystem keeps the file's pages cached (tmpfs, or no DONTNEED)")
    loaded = tf.read_table(path)  # without prefetch: header, index, metadata (and readahead)
    assert _resident_fraction(path, payload.offset, payload.length) < 0.5
    del loaded
    loaded = tf.read_table(path, prefetch=True)
    waited = time.monotonic() + 10  # the kernel reads in the background
    while _resident_fraction(path, payload.offset, payload.length) < 0.99:
        assert time.monotonic() < waited, "the payload was not read in"
        time.sleep(0.01)
    assert same_bits(loaded.table.decompress(), weight)


@pytest.mark.parametrize("section", ["meta", "block_base"])
def test_a_rejected_file_is_unmapped_while_its_error_is_kept(packed, section) -> None:
    path, _ = packed
    begin, _ = section_ranges(path)[section]
    flip_bit(path, begin + 1)
    with pytest.raises(tf.TableFileError) as kept:  # the error, its traceback and frames kept
        tf.read_table(path)
    assert kept.value.section == section
    assert str(path) not in Path("/proc/self/maps").read_text()


if __name__ == "__main__":
    # `python -m tests.tables.test_format`: pack this layout's golden files (write_golden).
    write_golden()
    print(f"wrote {GOLDEN} and {GOLDEN_CODED}")
