# SPDX-License-Identifier: Apache-2.0
"""One Triton request scores a batch end to end: ibpembed's lookups, then a small dense model.

    python examples/triton_ensemble.py TABLES -o REPO     # writes three models into REPO
    tritonserver --model-repository=REPO                  # (see deploy/triton/README.md)

``REPO/ibpembed`` pools every feature of the table set (``ibpembed triton-repo``), ``REPO/dense``
is a Python-backend MLP over the pooled features (random weights here; a real deployment loads
the model's own dense weights the same way), and ``REPO/dlrm`` is a Triton ensemble wiring the
first into the second: clients send ``<f>__ids`` and ``<f>__lengths`` per feature and get
``score`` [B, 1] back, the pooled embeddings never leaving the server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from ibpembed.tables.manifest import read_manifest
from ibpembed.triton.repo import feature_ios, write_repository

DENSE_MODEL_PY = """\
# The ensemble's dense half: sigmoid(MLP(concatenated pooled features)), weights from dense.pt.
import json
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.inputs = [i["name"] for i in config["input"]]
        here = Path(args["model_repository"]) / args["model_version"]
        self.mlp = torch.jit.load(str(here / "dense.pt"))

    def execute(self, requests):
        responses = []
        for request in requests:
            pooled = [
                torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, n).to_dlpack())
                for n in self.inputs
            ]
            with torch.no_grad():
                score = torch.sigmoid(self.mlp(torch.cat(pooled, dim=1))).contiguous()
            out = pb_utils.Tensor.from_dlpack("score", score)
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
"""


def dense_mlp(width: int, seed: int = 0) -> nn.Module:
    """The example's dense model: [B, width] pooled features -> [B, 1] logits."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1)).eval()


def write_ensemble(tables: Path, repo: Path, *, seed: int = 0) -> list[str]:
    """Write the ``ibpembed``, ``dense`` and ``dlrm`` models; returns the features, in the
    order the dense model concatenates them."""
    ios = feature_ios(read_manifest(tables), "sum")
    write_repository(tables, repo, name="ibpembed", version=1)
    width = sum(io.dim for io in ios)
    dense = repo / "dense"
    (dense / "1").mkdir(parents=True)
    torch.jit.script(dense_mlp(width, seed)).save(str(dense / "1" / "dense.pt"))
    (dense / "1" / "model.py").write_text(DENSE_MODEL_PY)
    inputs = ",\n".join(
        f'  {{ name: "{io.output("sum")}" data_type: TYPE_FP32 dims: [ -1, {io.dim} ] }}'
        for io in ios
    )
    (dense / "config.pbtxt").write_text(
        f"""name: "dense"
backend: "python"
max_batch_size: 0
input [
{inputs}
]
output [ {{ name: "score" data_type: TYPE_FP32 dims: [ -1, 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""
    )
    ensemble_inputs = ",\n".join(
        f'  {{ name: "{name}" data_type: {dtype} dims: [ -1 ] }}'
        for io in ios
        for name, dtype in ((io.ids, "TYPE_INT64"), (io.lengths, "TYPE_INT32"))
    )
    lookup_inputs = "\n".join(
        f'      input_map {{ key: "{name}" value: "{name}" }}'
        for io in ios
        for name in (io.ids, io.lengths)
    )
    pooled = "\n".join(
        f'      output_map {{ key: "{io.output("sum")}" value: "{io.output("sum")}" }}'
        for io in ios
    )
    dense_inputs = "\n".join(
        f'      input_map {{ key: "{io.output("sum")}" value: "{io.output("sum")}" }}' for io in ios
    )
    dlrm = repo / "dlrm"
    (dlrm / "1").mkdir(parents=True)
    (dlrm / "config.pbtxt").write_text(
        f"""name: "dlrm"
platform: "ensemble"
max_batch_size: 0
input [
{ensemble_inputs}
]
output [ {{ name: "score" data_type: TYPE_FP32 dims: [ -1, 1 ] }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "ibpembed"
      model_version: -1
{lookup_inputs}
{pooled}
    }},
    {{
      model_name: "dense"
      model_version: -1
{dense_inputs}
      output_map {{ key: "score" value: "score" }}
    }}
  ]
}}
"""
    )
    return [io.feature for io in ios]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", type=Path, help="a packed table set")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="REPO")
    args = parser.parse_args(argv)
    features = write_ensemble(args.tables, args.output)
    print(f"wrote models ibpembed, dense and dlrm to {args.output} ({len(features)} features)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
