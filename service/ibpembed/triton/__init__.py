# SPDX-License-Identifier: Apache-2.0
"""Serving table sets from NVIDIA Triton Inference Server: a Python-backend model
(:mod:`ibpembed.triton.model`) and the repository writer behind ``ibpembed triton-repo``
(:mod:`ibpembed.triton.repo`). See deploy/triton/README.md.
"""
