# SPDX-License-Identifier: Apache-2.0
"""Inference requests to a real Triton server through ``tritonclient``, HTTP or gRPC, with
inputs and outputs optionally in Triton's system shared memory.

Torch-free and ibpembed-free on purpose: tritonclient's gRPC client needs protobuf<7, so the
gRPC requests run in a venv of their own (``make setup`` builds ``.venv-triton-grpc``), as
``python triton_requests.py SPEC.json RESULT.json``. The HTTP requests run in the test process.

A request is ``{"inputs": {name: .npy path}, "outputs": {name: [dtype, shape]} | null,
"parameters": {...}, "shm": bool, "model": str, "version": str}``; its result is
``{"outputs": {name: .npy path}}`` or ``{"error": message}``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np

TRITON_DTYPES = {
    np.dtype("int64"): "INT64",
    np.dtype("int32"): "INT32",
    np.dtype("float32"): "FP32",
}


def run_requests(protocol: str, url: str, requests: list[dict[str, Any]], out_dir: Path) -> list:
    """Send each request in turn; errors are results, not exceptions."""
    if protocol == "grpc":
        import tritonclient.grpc as client_lib
    else:
        import tritonclient.http as client_lib
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    client = client_lib.InferenceServerClient(url)
    results = []
    for k, request in enumerate(requests):
        arrays = {name: np.load(path) for name, path in request["inputs"].items()}
        regions: list[tuple[str, Any]] = []
        try:
            inputs, outputs = [], []
            for name, array in arrays.items():
                item = client_lib.InferInput(name, list(array.shape), TRITON_DTYPES[array.dtype])
                if request.get("shm"):
                    region = f"in_{k}_{name}_{uuid.uuid4().hex[:8]}"
                    size = max(array.nbytes, 1)
                    handle = shm.create_shared_memory_region(region, f"/{region}", size)
                    regions.append((region, handle))
                    shm.set_shared_memory_region(handle, [array])
                    client.register_system_shared_memory(region, f"/{region}", size)
                    item.set_shared_memory(region, array.nbytes)
                else:
                    item.set_data_from_numpy(array)
                inputs.append(item)
            wanted = request.get("outputs") or {}
            out_regions = {}
            for name, (dtype, shape) in wanted.items():
                out = client_lib.InferRequestedOutput(name)
                if request.get("shm"):
                    size = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
                    region = f"out_{k}_{name}_{uuid.uuid4().hex[:8]}"
                    handle = shm.create_shared_memory_region(region, f"/{region}", size)
                    regions.append((region, handle))
                    client.register_system_shared_memory(region, f"/{region}", size)
                    out.set_shared_memory(region, size)
                    out_regions[name] = (handle, dtype, shape)
                outputs.append(out)
            response = client.infer(
                request.get("model", "ibpembed"),
                inputs,
                model_version=request.get("version", ""),
                outputs=outputs or None,
                parameters=request.get("parameters") or None,
            )
            saved = {}
            names = list(wanted) or [o["name"] for o in _outputs_of(response, protocol)]
            for name in names:
                if name in out_regions:
                    handle, dtype, shape = out_regions[name]
                    value = shm.get_contents_as_numpy(handle, np.dtype(dtype), shape).copy()
                else:
                    value = response.as_numpy(name)
                path = out_dir / f"result_{k}_{name}.npy"
                np.save(path, value)
                saved[name] = str(path)
            results.append({"outputs": saved})
        except InferenceServerException as err:
            results.append({"error": err.message()})
        finally:
            for region, handle in regions:
                with contextlib.suppress(InferenceServerException):
                    client.unregister_system_shared_memory(region)
                shm.destroy_shared_memory_region(handle)
    client.close()
    return results


def _outputs_of(response: Any, protocol: str) -> list[dict[str, Any]]:
    if protocol == "grpc":
        return [{"name": o.name} for o in response.get_response().outputs]
    return response.get_response()["outputs"]


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    results = run_requests(spec["protocol"], spec["url"], spec["requests"], result_path.parent)
    result_path.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
