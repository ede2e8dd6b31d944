# SPDX-License-Identifier: Apache-2.0
"""Benchmarks of the ibpembed codec and lookups (run as modules: ``python -m benchmarks.codec``)."""
