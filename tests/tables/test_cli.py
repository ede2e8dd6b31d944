# SPDX-License-Identifier: Apache-2.0
"""``ibpembed pack | inspect | verify``: reports and exit codes (0 ok, 1 data fault, 2 usage)."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ibpembed import cli as main_cli
from ibpembed.tables import cli
from ibpembed.tables import format as tf
from ibpembed.tables import writer as tw
from ibpembed.tables.importers import TableSet, TableSource
from ibpembed.tables.manifest import read_manifest
from ibpembed.tables.pack import pack_table_set
from ibpembed.tables.store import TableStore
from tests.tables.helpers import (
    flip_bit,
    reseal_section,
    same_bits,
    section_ranges,
    trained_like,
)

REPO = Path(__file__).resolve().parents[2]


def run(argv: list[str]) -> int:
    """Run a subcommand through a parser that only has the table commands."""
    parser = argparse.ArgumentParser(prog="ibpembed")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"embedding_bags.t_user.weight": trained_like(300, 16)}, src / "ckpt.pt")
    np.save(src / "item.npy", trained_like(100, 8, torch.float16).numpy())
    return src


@pytest.fixture
def packed(tmp_path: Path, sources: Path) -> Path:
    out = tmp_path / "out"
    assert run(["pack", str(sources), "-o", str(out), "--no-progress"]) == 0
    return out


def test_pack_reports_every_table(tmp_path: Path, sources: Path, capsys) -> None:
    out = tmp_path / "out"
    code = run(
        [
            "pack",
            str(sources / "ckpt.pt"),
            str(sources / "item.npy"),
            "-o",
            str(out),
            "--feature",
            "user_id=t_user",
            "--json",
            "--no-progress",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["table"]: r for r in report["tables"]}
    assert set(rows) == {"t_user", "item"}
    assert rows["t_user"]["rows"] == 300 and rows["item"]["dtype"] == "float16"
    assert rows["t_user"]["chunk_bits"] in (16, 32, 64)
    assert rows["t_user"]["savings"] > 0  # small trained-like values compress
    store = TableStore.load(out, verify=True)
    with store.acquire() as snap:
        assert snap.table_for_feature("user_id")[0] == "t_user"
        assert same_bits(snap.tables["t_user"].decompress(), trained_like(300, 16))


def test_pack_text_report_and_table_selection(tmp_path: Path, sources: Path, capsys) -> None:
    out = tmp_path / "out"
    assert (
        run(
            [
                "pack",
                str(sources),
                "-o",
                str(out),
                "--table",
                "item",
                "--method",
                "paper",
                "--no-progress",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "item" in text and "t_user" not in text and "wrote 1 table(s)" in text


def test_text_reports_have_every_column_and_no_trailing_spaces(
    tmp_path: Path, sources: Path, capsys
) -> None:
    out = tmp_path / "out"
    assert run(["pack", str(sources), "-o", str(out), "--no-progress", "--code-bits", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "table", "rows", "dim", "dtype", "chunk_bits", "code_bits", "savings", "seconds",
    ]  # fmt: skip
    assert [line.split()[5] for line in lines[1:3]] == ["1", "1"]
    assert run(["inspect", str(out)]) == 0
    lines += capsys.readouterr().out.splitlines()
    assert [line for line in lines if line != line.rstrip()] == []


def test_every_flag_has_help() -> None:
    subparsers = argparse.ArgumentParser(prog="ibpembed").add_subparsers()
    cli.register(subparsers)
    for name, command in subparsers.choices.items():
        bare = [a.option_strings or a.dest for a in command._actions if not a.help]
        assert bare == [], f"ibpembed {name}: no help for {bare}"


def test_table_selection_applies_before_other_entries_are_checked(tmp_path: Path) -> None:
    emb = trained_like(100, 8)
    checkpoint = {"model": {"emb": emb, "pos_ids": torch.arange(20).reshape(2, 10)}}
    torch.save(checkpoint, tmp_path / "m.pt")
    out = tmp_path / "out"
    argv = ["pack", str(tmp_path / "m.pt"), "-o", str(out), "--no-progress"]
    assert run(argv) == 1  # everything: the int64 matrix is no table
    assert run([*argv, "--table", "model.emb"]) == 0
    with TableStore.load(out, verify=True).acquire() as snap:
        assert list(snap.tables) == ["model.emb"]
        assert same_bits(snap.tables["model.emb"].decompress(), emb)


def test_an_unknown_table_lists_the_tables_the_sources_hold(
    tmp_path: Path, sources: Path, capsys
) -> None:
    """An unknown ``--table`` is named with the tables every source holds, read before the
    selection (which leaves none of them)."""
    torch.save({"emb": trained_like(10, 4)}, tmp_path / "m.pt")
    save_file(
        {"cat.weight": trained_like(6, 4), "bias": torch.zeros(4)}, sources / "extra.safetensors"
    )
    argv = ["pack", str(sources / "ckpt.pt"), "-o", str(tmp_path / "out"), "--no-progress"]
    assert run([*argv, "--table", "T_USER"]) == 1
    err = capsys.readouterr().err
    assert "no table named ['T_USER']; the sources hold ['t_user']" in err, err
    argv = ["pack", str(sources), str(tmp_path / "m.pt"), "-o", str(tmp_path / "out")]
    assert run([*argv, "--table", "item", "--table", "nope", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert (
        "no table named ['nope']; the sources hold ['cat.weight', 'emb', 'item', 't_user']" in err
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["pack", "{tmp}/missing.pt", "-o", "{tmp}/out"],
        ["pack", "{src}", "-o", "{tmp}/out", "--table", "nope"],
        ["pack", "{src}", "-o", "{tmp}/out", "--feature", "f=nope"],
    ],
)
def test_pack_faults_exit_1(tmp_path: Path, sources: Path, argv: list[str], capsys) -> None:
    argv = [a.format(tmp=tmp_path, src=sources) for a in argv]
    assert run([*argv, "--no-progress"]) == 1
    assert "ibpembed pack: error:" in capsys.readouterr().err
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_tensor_is_refused_by_name(tmp_path: Path, layout: str, capsys) -> None:
    """Every 2-D tensor is a table by default: a sparse one is named, with the way to leave it
    out, instead of a traceback."""
    dense = trained_like(20, 4)
    adj = torch.eye(5).to_sparse() if layout == "coo" else torch.eye(5).to_sparse_csr()
    torch.save({"emb": dense, "adj": adj}, tmp_path / "m.pt")
    argv = ["pack", str(tmp_path / "m.pt"), "-o", str(tmp_path / "out"), "--no-progress"]
    assert run(argv) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'm.pt'}: table 'adj' is a sparse tensor" in err, err
    assert "--table" in err and len(err.splitlines()) == 1
    assert run([*argv, "--table", "emb"]) == 0


@pytest.mark.parametrize("merge", [False, True])
def test_pack_removes_only_the_files_it_wrote(tmp_path: Path, sources: Path, merge: bool) -> None:
    """A pack sweeps what a previous manifest named and what a killed pack left (content-named
    files, temporaries), never a table file someone else wrote into the directory."""
    out = tmp_path / "out"
    out.mkdir()
    own = out / "user_emb.ibpt"  # the documented single-file writer, no manifest
    tw.pack_table(own, trained_like(50, 4), name="user_emb")
    left = tw.pack_table(out, trained_like(60, 4), name="killed", content_named=True).path
    temp = out / ".item.tmp-123-abcd0123"
    temp.write_bytes(b"partial")
    argv = ["pack", str(sources / "item.npy"), "-o", str(out), "--no-progress"]
    assert run([*argv, "--merge"] if merge else argv) == 0
    first = {e.file for e in read_manifest(out).tables.values()}
    assert own.exists() and not left.exists() and not temp.exists()
    assert run(["pack", str(sources / "ckpt.pt"), "-o", str(out), "--no-progress"]) == 0
    names = {p.name for p in out.glob("*.ibpt")}
    assert names == {own.name, *(e.file for e in read_manifest(out).tables.values())}
    assert not first & names  # the replaced set's files are gone
    assert tf.verify_file(own).name == "user_emb"


def test_table_names_longer_than_a_file_name_pack(tmp_path: Path) -> None:
    """A table's file name is cut from its name (its meta and the manifest keep it whole), so
    names past the 255-byte file name limit pack, also two that share their first 250 bytes."""
    names = ["e" * 250 + "_user", "e" * 250 + "_item", "ü" * 300]
    tables = {name: trained_like(40, 4, seed=i) for i, name in enumerate(names)}
    torch.save(tables, tmp_path / "m.pt")
    out = tmp_path / "out"
    assert run(["pack", str(tmp_path / "m.pt"), "-o", str(out), "--no-progress"]) == 0
    assert run(["verify", str(out)]) == 0
    assert len(list(out.glob("*.ibpt"))) == 3
    with TableStore.load(out, verify=True).acquire() as snap:
        assert sorted(snap.tables) == sorted(names)
        for name, weight in tables.items():
            assert same_bits(snap.tables[name].decompress(), weight)


def test_rows_wider_than_the_format_holds_are_refused_before_packing(
    tmp_path: Path, capsys
) -> None:
    """The 64 KiB row limit is checked with the other source checks, naming the table, before
    any table is packed (a table listed before it included)."""
    np.save(tmp_path / "a_first.npy", trained_like(100, 8).numpy())
    np.save(tmp_path / "z_wide.npy", np.zeros((2, 16385), np.float32))
    np.save(tmp_path / "z_widest.npy", np.zeros((2, 16384), np.float32))  # 65536 bytes: fits
    out = tmp_path / "out"
    argv = ["pack", str(tmp_path / "a_first.npy"), "-o", str(out), "--no-progress"]
    assert run([*argv[:2], str(tmp_path / "z_wide.npy"), *argv[2:]]) == 1
    err = capsys.readouterr().err
    assert (
        f"{tmp_path / 'z_wide.npy'}: table 'z_wide': rows must be at most 65536 bytes, got "
        "16385 x torch.float32 = 65540 bytes" in err
    ), err
    assert not out.exists()
    assert run([*argv[:2], str(tmp_path / "z_widest.npy"), *argv[2:]]) == 0


def _whole_then_cut(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


# A source file of each kind that its loader cannot read, and the words of the loader's reason.
BAD_SOURCES = {
    "truncated.npy": (
        lambda p: (np.save(p, np.zeros((50, 4), np.float32)), _whole_then_cut(p, 200)),
        "mmap length is greater than file size",
    ),
    "objects.npy": (
        lambda p: np.save(p, np.array([[1, "a"]], dtype=object)),
        "Python objects in dtype",
    ),
    "empty.npy": (lambda p: p.write_bytes(b""), "No data left in file"),
    "archive.npy": (
        lambda p: p.write_bytes(_npz_bytes()),
        "holds a NpzFile, not an array",
    ),
    "garbage.safetensors": (lambda p: p.write_bytes(b"garbage"), "cannot load with safetensors"),
    "truncated.safetensors": (
        lambda p: (save_file({"e": torch.zeros(50, 4)}, p), _whole_then_cut(p, 100)),
        "cannot load with safetensors",
    ),
}


def _npz_bytes() -> bytes:
    archive = io.BytesIO()
    np.savez(archive, a=np.zeros((2, 2), np.float32))
    return archive.getvalue()


@pytest.mark.parametrize("name", BAD_SOURCES)
@pytest.mark.parametrize("as_directory", [False, True])
def test_an_unreadable_source_file_is_a_fault_naming_it(
    tmp_path: Path, name: str, as_directory: bool, capsys
) -> None:
    """A corrupt or truncated .npy or .safetensors file exits 1 with one line naming the file,
    also when it is found in a directory, instead of a traceback or numpy's bare words."""
    folder = tmp_path / "src"
    folder.mkdir()
    make, reason = BAD_SOURCES[name]
    make(folder / name)
    target = folder if as_directory else folder / name
    assert run(["pack", str(target), "-o", str(tmp_path / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ibpembed pack: error: {folder / name}: "), err
    assert reason in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize(
    "argv",
    [["pack", "x.pt"], ["pack", "x.pt", "-o", "d", "--chunk-bits", "8"], ["verify"], ["frob"]],
)
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--align", "3"], "argument --align: must be a power of two <= 65536, got 3"),
        (["--align", "0"], "argument --align: must be a power of two"),
        (["--shards", "0"], "argument --shards: must be >= 1, got 0"),
        (["--shard-address", "h-{shard}:1"], "argument --shard-address: needs --shards"),
        (["--feature", "foo"], "argument --feature: expected FEATURE=TABLE, got 'foo'"),
        (["--feature", "f="], "argument --feature: expected FEATURE=TABLE, got 'f='"),
        (["--sample-rows", "-5"], "argument --sample-rows: must be >= 0, got -5"),
        (["--sample-rows", "many"], "argument --sample-rows: invalid int value: 'many'"),
        (
            ["--method", "raw", "--code-bits", "3"],
            "argument --code-bits: method 'raw' has no codebooks (it takes --code-bits 1 only)",
        ),
        (
            ["--method", "paper", "--code-bits", "2"],
            "argument --code-bits: method 'paper' has no codebooks",
        ),
        (["--table", "item", "--table", "item"], "argument --table: table 'item' is named twice"),
        (
            ["--feature", "f=item", "--feature", "f=t_user"],
            "argument --feature: feature 'f' is mapped to both 'item' and 't_user'",
        ),
    ],
)
def test_bad_pack_flags_exit_2_before_reading_a_source(
    tmp_path: Path, sources: Path, flags: list[str], message: str, capsys
) -> None:
    """A bad flag is a usage error (exit 2, as docs/format.md says), not a data fault (1),
    through the ``ibpembed`` command's own parser."""
    argv = ["pack", str(sources), "-o", str(tmp_path / "out"), "--no-progress", *flags]
    try:
        code = main_cli.main(argv)
    except SystemExit as exit_info:  # argparse's type checks
        code = exit_info.code
    assert code == 2
    assert f"ibpembed pack: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_feature_may_not_take_a_tables_only_feature(tmp_path: Path, sources: Path, capsys):
    """`--feature item=t_user` would leave table item packed but read by no lookup (lookups
    name features): refused, saying how to alias instead."""
    argv = ["pack", str(sources), "-o", str(tmp_path / "out"), "--no-progress"]
    assert run([*argv, "--feature", "item=t_user"]) == 1
    err = capsys.readouterr().err
    assert (
        "--feature item=t_user maps every feature of table 'item' to another table, leaving "
        "nothing to look 'item' up with" in err
    ), err
    assert not (tmp_path / "out").exists()
    assert run([*argv, "--feature", "item_alias=t_user"]) == 0


def test_a_feature_mapped_away_leaves_the_tables_feature_names(tmp_path: Path) -> None:
    """A table keeps, in its manifest entry and meta, the features still mapped to it."""
    two = TableSource("two", trained_like(20, 4), feature_names=("f", "g"))
    one = TableSource("one", trained_like(20, 4, seed=1))
    pack_table_set(tmp_path, TableSet((two, one), {"f": "one"}), sample_rows=None)
    found = read_manifest(tmp_path)
    assert dict(found.features) == {"f": "one", "g": "two", "one": "one"}
    assert found.tables["two"].feature_names == ("g",)
    assert tf.read_table(tmp_path / found.tables["two"].file).meta["feature_names"] == ["g"]


def test_pack_code_bits_writes_codebooks_that_verify(tmp_path: Path, sources: Path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["pack", str(sources / "ckpt.pt"), "-o", str(out), "--json", "--no-progress"]
    assert run([*argv, "--code-bits", "3", "--chunk-bits", "32"]) == 0
    report = json.loads(capsys.readouterr().out)["tables"][0]
    assert (report["code_bits"], report["chunk_bits"]) == (3, 32)
    one = next(out.glob("t_user.*.ibpt"))
    assert run(["inspect", str(one), "--json"]) == 0
    desc = json.loads(capsys.readouterr().out)["tables"][0]
    assert desc["header"]["code_bits"] == 3
    bitval = next(s for s in desc["sections"] if s["kind"] == "bitval")
    assert bitval["length"] == 8 * 7 * desc["header"]["num_chunks"]  # K = 2^3 - 1 patterns
    assert run(["verify", str(out)]) == 0


def test_inspect_directory_and_file(packed: Path, capsys) -> None:
    assert run(["inspect", str(packed)]) == 0
    text = capsys.readouterr().out
    assert "feature t_user -> t_user" in text and "payload" in text and "header_xxh3" in text
    one = next(packed.glob("item.*.ibpt"))
    assert run(["inspect", str(one), "--json"]) == 0
    desc = json.loads(capsys.readouterr().out)["tables"][0]
    assert [s["kind"] for s in desc["sections"]] == [
        "mask",
        "bitval",
        "block_base",
        "row_units",
        "bitmask",
        "payload",
        "meta",
    ]
    assert desc["header"]["num_rows"] == 100 and desc["meta"]["name"] == "item"


def test_inspect_prices_a_hot_tier(packed: Path, capsys) -> None:
    """--hot-tier adds each table's tier bytes and the savings net of it (header sizes only)."""
    assert run(["inspect", str(packed), "--json"]) == 0
    plain = {s["table"]: s for s in json.loads(capsys.readouterr().out)["summary"]}
    for budget in ("10%", "100%", "savings", "all", "0"):
        assert run(["inspect", str(packed), "--json", "--hot-tier", budget]) == 0
        summary = {s["table"]: s for s in json.loads(capsys.readouterr().out)["summary"]}
        for name, s in summary.items():
            raw, stored, tier = s["raw_bytes"], s["stored_bytes"], s["tier_bytes"]
            policy = s["policy_bytes"]  # the admission policy's state, paid from the budget
            assert stored == plain[name]["stored_bytes"]
            assert s["net_savings"] == pytest.approx(1 - (stored + tier + policy) / raw)
            assert (tier > 0) == (policy > 0)  # no rows bought: no state kept either
            if budget in ("10%", "100%"):
                assert tier + policy <= raw * int(budget[:-1]) // 100
            elif budget == "savings":  # the table with its tier stays within its raw bytes
                assert stored + tier + policy <= max(raw, stored)
            elif budget == "all":
                assert tier >= raw  # every row decoded, plus what finds them
            else:
                assert tier == 0 and s["net_savings"] == pytest.approx(s["savings"])
        if budget == "10%":  # 1.9 kB: less than the policy's smallest id buffer
            assert summary["t_user"]["tier_bytes"] == 0
        if budget == "100%":
            assert summary["t_user"]["tier_bytes"] > 0
    assert run(["inspect", str(packed), "--hot-tier", "5%"]) == 0
    text = capsys.readouterr().out
    assert "tier_bytes" in text and "policy_bytes" in text and "net_savings" in text
    assert "total" in text


@pytest.mark.parametrize("bad", ["-5%", "lots", "5%%"])
def test_inspect_refuses_a_malformed_budget(packed: Path, bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(["inspect", str(packed), f"--hot-tier={bad}"])
    assert exit_info.value.code == 2
    assert "hot tier budget" in capsys.readouterr().err


def test_inspect_does_not_decode(packed: Path, capsys) -> None:
    one = next(packed.glob("item.*.ibpt"))
    begin, _ = section_ranges(one)["payload"]
    flip_bit(one, begin + 1)
    assert run(["inspect", str(one)]) == 0  # headers are fine; the payload is verify's job
    assert run(["verify", str(one)]) == 1


@pytest.mark.parametrize(
    "where", ["mask", "bitval", "block_base", "row_units", "bitmask", "meta", "gap"]
)
@pytest.mark.parametrize("target", ["file", "dir"])
def test_inspect_checks_every_section_but_the_payload(
    packed: Path, where: str, target: str, capsys
) -> None:
    """A flipped bit anywhere but in the payload is caught by inspect as by a load (the small
    sections and the zero gaps are hashed; the payload is verify's)."""
    one = next(packed.glob("t_user.*.ibpt"))
    ranges = section_ranges(one)
    offset = ranges["payload"][0] - 1 if where == "gap" else ranges[where][0]
    assert where != "gap" or offset >= ranges["bitmask"][1]  # the page-aligned payload's gap
    flip_bit(one, offset)
    assert run(["inspect", str(one if target == "file" else packed)]) == 1
    err = capsys.readouterr().err
    section = "payload" if where == "gap" else where  # a gap is named by the section after it
    assert err.startswith(f"ibpembed inspect: error: {one}: section '{section}': "), err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        (b"[1]", "section 'meta': expected a JSON object with a 'name'"),
        (b'{"gpu_layout": {}}', "section 'meta': expected a JSON object with a 'name'"),
        (b'{"name": "t_user", "gpu_layout": "x"}', "'gpu_layout' must be an object"),
    ],
)
def test_inspect_refuses_a_malformed_meta_with_sound_checksums(
    packed: Path, meta: bytes, problem: str, capsys
) -> None:
    one = next(packed.glob("t_user.*.ibpt"))
    begin, end = section_ranges(one)["meta"]
    reseal_section(one, tf.SectionKind.META, meta.ljust(end - begin))  # JSON allows the spaces
    assert run(["inspect", str(one)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ibpembed inspect: error: ") and problem in err, err
    assert len(err.splitlines()) == 1


def test_inspect_checks_each_file_against_its_manifest_entry(packed: Path, capsys) -> None:
    """A sound file that is not the one the manifest names (swapped behind its back) is the
    mismatch a load refuses; a missing one is named."""
    entries = read_manifest(packed).tables
    user, item = (packed / entries[name].file for name in ("t_user", "item"))
    item.unlink()
    assert run(["inspect", str(packed)]) == 1
    assert f"table 'item': file {item} is missing" in capsys.readouterr().err
    user.rename(item)
    assert run(["inspect", str(packed)]) == 1
    assert "table 'item': " in capsys.readouterr().err
    assert run(["inspect", str(item)]) == 0  # the file alone is sound


def test_inspect_names_the_dtype(packed: Path, capsys) -> None:
    assert run(["inspect", str(next(packed.glob("item.*.ibpt")))]) == 0
    assert "  dtype            float16 (code 1)\n" in capsys.readouterr().out


def test_inspect_shows_files_of_other_layouts(capsys) -> None:
    # inspect decodes nothing, so a file in a layout this build cannot decode still shows.
    old = Path(__file__).parent / "data" / "golden_layout1.ibpt"
    assert run(["inspect", str(old), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tables"][0]["header"]["layout_version"] == 1


def test_inspect_foreign_file_exits_1(tmp_path: Path, capsys) -> None:
    (tmp_path / "x.ibpt").write_bytes(b"hello world" * 20)
    assert run(["inspect", str(tmp_path / "x.ibpt")]) == 1
    assert "not an ibpembed table file" in capsys.readouterr().err


def test_verify_ok_then_each_fault(packed: Path, capsys) -> None:
    assert run(["verify", str(packed)]) == 0
    assert capsys.readouterr().out.count("OK") == 2
    victim = next(packed.glob("t_user.*.ibpt"))
    begin, end = section_ranges(victim)["payload"]
    flip_bit(victim, (begin + end) // 2)
    assert run(["verify", str(packed)]) == 1
    captured = capsys.readouterr()
    assert captured.out.count("OK") == 1  # the healthy table still verifies
    assert f"FAIL {victim}: section 'payload'" in captured.out  # the report is on stdout
    assert captured.err == ""
    victim.unlink()
    assert run(["verify", str(packed)]) == 1
    assert f"table 't_user': file {victim} is missing" in capsys.readouterr().out
    assert run(["verify", str(packed / "nothing-here")]) == 1


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_missing_path_is_one_plain_error_line(tmp_path: Path, command: str, capsys) -> None:
    """No '[Errno 2]' or quotes: the path and the reason, as other tools say it."""
    assert run([command, str(tmp_path / "nope")]) == 1
    captured = capsys.readouterr()
    assert (
        captured.err
        == f"ibpembed {command}: error: {tmp_path / 'nope'}: no such file or directory\n"
    )
    assert captured.out == ""


def test_an_os_error_names_the_path_and_the_reason(tmp_path: Path, sources: Path, capsys) -> None:
    (tmp_path / "file").write_bytes(b"")
    argv = ["pack", str(sources), "-o", str(tmp_path / "file"), "--no-progress"]
    assert run(argv) == 1
    assert capsys.readouterr().err == (f"ibpembed pack: error: {tmp_path / 'file'}: file exists\n")


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_the_root_of_a_sharded_set_names_its_shards(
    tmp_path: Path, sources: Path, command: str, capsys
) -> None:
    out = tmp_path / "out"
    argv = ["pack", str(sources), "-o", str(out), "--shards", "2", "--no-progress"]
    assert run(argv) == 0
    capsys.readouterr()
    assert run([command, str(out)]) == 1
    err = capsys.readouterr().err
    assert (
        f"holds 2 row shards (shard_map.json), each a table set: name one, e.g. {out}/shard-0-of-2"
        in err
    )
    assert run([command, str(out / "shard-0-of-2")]) == 0


def test_commands_are_registered_with_the_ibpembed_command(packed: Path) -> None:
    assert main_cli.COMMANDS["verify"][0] == "ibpembed.tables.cli"
    done = subprocess.run(
        [sys.executable, "-m", "ibpembed.cli", "verify", str(packed)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def test_inspect_reports_sizes_and_savings_per_table_and_in_total(packed: Path, capsys) -> None:
    assert run(["inspect", str(packed), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    summary = {s["table"]: s for s in result["summary"]}
    assert set(summary) == set(result["manifest"]["tables"])
    for name, line in summary.items():
        entry = result["manifest"]["tables"][name]
        assert (line["rows"], line["dim"]) == (entry["num_rows"], entry["dim"])
        desc = next(d for d in result["tables"] if d["meta"]["name"] == name)
        assert line["raw_bytes"] == entry["num_rows"] * desc["header"]["row_bytes"]
        data = [s["length"] for s in desc["sections"] if s["kind"] != "meta"]
        assert line["stored_bytes"] == sum(data)
        assert line["savings"] == pytest.approx(1 - line["stored_bytes"] / line["raw_bytes"])
    assert run(["inspect", str(packed)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("table  "))
    assert lines[header].split() == [
        "table", "rows", "dim", "dtype", "raw_bytes", "stored_bytes", "savings",
    ]  # fmt: skip
    total = lines[-1].split()
    raw = sum(s["raw_bytes"] for s in summary.values())
    stored = sum(s["stored_bytes"] for s in summary.values())
    assert total[0] == "total" and total[2:4] == [f"{raw:,}", f"{stored:,}"]
    assert total[4] == f"{100 * (1 - stored / raw):.1f}%"
    dtypes = {line.split()[0]: line.split()[3] for line in lines[header + 1 : -1]}
    assert dtypes == {name: s["dtype"] for name, s in summary.items()}


def test_verify_json_reports_every_table_and_the_fault(packed: Path, capsys) -> None:
    assert run(["verify", str(packed), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and len(report["tables"]) == 2
    assert all(t["ok"] and t["rows"] > 0 for t in report["tables"])
    victim = next(packed.glob("t_user.*.ibpt"))
    begin, end = section_ranges(victim)["payload"]
    flip_bit(victim, (begin + end) // 2)
    assert run(["verify", str(packed), "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout holds the JSON alone
    (bad,) = [t for t in report["tables"] if not t["ok"]]
    assert report["ok"] is False and bad["file"] == str(victim)
    assert "section 'payload'" in bad["error"]
    assert run(["verify", str(packed / "nothing-here"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
