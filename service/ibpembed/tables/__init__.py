# SPDX-License-Identifier: Apache-2.0
"""Table files (.ibpt), table sets with a manifest, importers and the live TableStore."""
