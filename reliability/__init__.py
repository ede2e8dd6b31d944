# SPDX-License-Identifier: Apache-2.0
"""Reliability campaigns: fuzzers, soak, fault injection and security checks (see README.md)."""
