# SPDX-License-Identifier: Apache-2.0
"""Generated protobuf and gRPC stubs for ``ibpembed.v1`` (``python proto/generate.py``)."""
