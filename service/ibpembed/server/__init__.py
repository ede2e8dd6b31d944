# SPDX-License-Identifier: Apache-2.0
"""The gRPC lookup server: ``app`` (wiring, lifecycle), ``servicer`` (translation only),
``interceptors`` (auth, the error map), ``errors``, ``config``, ``demo`` and ``cli``."""
