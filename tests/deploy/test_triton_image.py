# SPDX-License-Identifier: Apache-2.0
"""The Dockerfile's ``triton`` target, checked offline (hadolint runs on the whole file in
test_deploy): it builds from the server image's build stage, like CI."""

import re

from tests.deploy.dockerfile import DOCKERFILE, stages


def test_one_build_stage_serves_both_images() -> None:
    by_name = stages()
    assert list(by_name) == ["build", "triton", "server"]  # the server last: the default target
    for runtime in ("triton", "server"):
        copies = [args for op, args in by_name[runtime] if op == "COPY"]
        assert "--from=build /wheels /tmp/wheels" in copies


def test_triton_target_is_tritonserver_with_the_runtime_pins_and_two_wheels() -> None:
    by_name = stages()
    build, runtime = by_name["build"], by_name["triton"]
    assert runtime[0][1].startswith("nvcr.io/nvidia/tritonserver:")
    # Pinned requirements before any source, wheels built, no dev setup.
    copies = [args for op, args in build if op == "COPY"]
    assert copies[0].startswith("requirements/runtime.txt requirements/base.txt")
    assert not any(args.split()[0] == "." for args in copies), "the whole tree is copied"
    runs = " ".join(args for op, args in build + runtime if op == "RUN")
    assert "make setup" not in runs and "dev.txt" not in runs and "pytriton" not in runs
    assert "pip wheel --no-deps --no-build-isolation -w /wheels . clients/python" in runs
    runtime_runs = [args for op, args in runtime if op == "RUN"]
    pins = next(i for i, r in enumerate(runtime_runs) if "-r /tmp/runtime.txt" in r)
    wheels = next(i for i, r in enumerate(runtime_runs) if "--no-deps /tmp/wheels/" in r)
    assert pins < wheels
    runtime_copies = [args for op, args in runtime if op == "COPY"]
    assert runtime_copies == [
        "requirements/runtime.txt /tmp/runtime.txt",
        "--from=build /wheels /tmp/wheels",
    ]
    # No Python version written into the image: the venv's site-packages is found at build time.
    assert not re.search(r"python3\.\d+", DOCKERFILE.read_text()), "a hard-coded Python version"
    env = " ".join(args for op, args in runtime if op == "ENV")
    assert 'PYTHONPATH="/opt/venv/site-packages"' in env
    (user,) = [args for op, args in runtime if op == "USER"]
    assert user.split(":")[0] not in ("0", "root")
