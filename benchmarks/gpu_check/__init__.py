# SPDX-License-Identifier: Apache-2.0
"""Validate and time the CUDA path on a GPU machine, in one run that cannot waste it.

    python3 -m benchmarks.gpu_check [--out PATH] [--deadline-s 480] [--only PHASES]
                                    [--skip-build] [--table-gib 8] [--dry-run]

(scripts/gpu_run.sh is the device command: it builds, runs this under a deadline and leaves
at most 8 files in $OUT.) Each phase runs in a child process of its own and writes its JSON as
it ends; the driver merges them into one report (``--out``, default ``$OUT/gpu_check.json``)
rewritten after every phase, with a tarball of the phase files beside it, so a CUDA fault
(which kills a process's CUDA context), an OOM or the machine's time limit costs one phase,
never what was measured before it. No phase starts past ``--deadline-s``, and a running one is
killed there. Phases, in order, one module each:

1. build (build.py): ibpembed._C and the UVA baseline from source on the device's torch.
2. preflight (preflight.py): registration in place, read back zero-copy; a 4 GiB table file
   mapped and registered as the store does, RssAnon before and after. Where registration
   fails, every later phase uses page-locked copies instead (``--pin copy``).
3. correctness (correctness.py): the CUDA ops against the CPU ops, bit for bit; on a failure
   or a fault again with synchronous staging, to tell a cp.async problem apart.
4. served (served.py): TableStore(device="cuda") and LookupEngine against the CPU engine.
5. h2d (h2d.py): the pinned host-to-device copy bandwidth, the ceiling.
6. timing (timing.py, tables.py): one child per row size (512 first: the raw-vs-H2D target is
   defined there; then 64, 1024, 256), the real table (data/), then R = 512 with 2 MB pages
   under the tables (THP_MEM_ALLOC_ENABLE=1); wall clock and CUDA events, every method and
   baseline; summary.py turns them into GB/s and the targets (reported, never asserted).
7. sanitizer (sanitizer.py): compute-sanitizer memcheck and racecheck, cut first at the
   deadline.

The report also carries the machine's facts (machine.py). --dry-run runs the same driver and
children on the CPU at toy sizes: the build's plan up to the compilers, the preflight's
mappings, table construction and tiling (checked against the CPU decoder), id streams, the CPU
baselines, the served path on a CPU store, the report. With no GPU to compare, the correctness
checks compare the CPU ops with independent answers instead. Needs only torch, numpy and this
repository (no torchrec/fbgemm, nothing downloaded).
"""
