# SPDX-License-Identifier: Apache-2.0
"""A hostile caller in a process of its own: it drops to an unprivileged user, then tries to
register, read and overwrite another process's shm object through a server that can open it.

    python -m reliability.shm_attacker TARGET VICTIM_SHM [--token T] [--uid 65534]

Prints one JSON object: the status code of each attempt (or what the kernel said locally).
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from collections.abc import Callable

import grpc

from ibpembed_client.v1 import lookup_pb2 as pb
from ibpembed_client.v1 import lookup_pb2_grpc

SHM_DIR = "/dev/shm"


def _code(call: Callable[[], object]) -> str:
    try:
        call()
    except grpc.RpcError as err:
        return err.code().name
    return "OK"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("victim")
    parser.add_argument("--token", default=None)
    parser.add_argument("--uid", type=int, default=65534)
    args = parser.parse_args()
    # The channel is made first: grpc imports its channel module on first use, and a checkout
    # the stranger cannot read (a private temporary directory) would then fail the import. It
    # connects on the first call, after the drop.
    stub = lookup_pb2_grpc.EmbeddingLookupStub(grpc.insecure_channel(args.target))
    # Everything is imported; from here on this process has a stranger's rights only.
    os.setgroups([])
    os.setgid(args.uid)
    os.setuid(args.uid)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    outcome: dict[str, str] = {}
    try:
        os.close(os.open(SHM_DIR + args.victim, os.O_RDWR))
        outcome["open_locally"] = "OK"
    except PermissionError:
        outcome["open_locally"] = "EACCES"

    def register(nonce: bytes, name: str = "stolen") -> None:
        request = pb.RegisterRegionRequest(
            name=name, shm_name=args.victim, byte_size=4096, nonce=nonce
        )
        stub.RegisterRegion(request, timeout=10, metadata=metadata)

    outcome["register_without_nonce"] = _code(lambda: register(b""))
    challenge = pb.ChallengeRegionRequest(shm_name=args.victim)
    nonce = stub.ChallengeRegion(challenge, timeout=10, metadata=metadata).nonce
    outcome["register_with_unwritten_nonce"] = _code(lambda: register(nonce))
    # The nonce written into an object of its own, then presented for the victim's.
    own = f"/ibpembed-attacker-{uuid.uuid4().hex[:8]}"
    fd = os.open(SHM_DIR + own, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        nonce = stub.ChallengeRegion(challenge, timeout=10, metadata=metadata).nonce
        os.pwrite(fd, nonce, 0)
        outcome["register_with_nonce_in_own_object"] = _code(lambda: register(nonce))
        # The nonce of its own object's challenge, presented for the victim's.
        own_challenge = pb.ChallengeRegionRequest(shm_name=own)
        nonce = stub.ChallengeRegion(own_challenge, timeout=10, metadata=metadata).nonce
        os.pwrite(fd, nonce, 0)
        outcome["register_with_nonce_for_own_object"] = _code(lambda: register(nonce))
    finally:
        os.close(fd)
        os.unlink(SHM_DIR + own)
    # Read (inputs from it) and write (outputs into it) under the name it tried to register.
    read = pb.LookupRequest(pooling=pb.POOLING_SUM)
    read.features.add(name="user")
    read.input_region.name = "stolen"
    read.input_region.num_ids.append(1)
    read.input_region.batch_sizes.append(1)
    outcome["read_through_lookup"] = _code(lambda: stub.Lookup(read, timeout=10, metadata=metadata))
    write = pb.LookupRequest(pooling=pb.POOLING_SUM)
    feature = write.features.add(name="user")
    feature.ids = (1).to_bytes(8, "little")
    feature.lengths = (1).to_bytes(4, "little")
    write.output_region.name = "stolen"
    outcome["write_through_lookup"] = _code(
        lambda: stub.Lookup(write, timeout=10, metadata=metadata)
    )
    listed = stub.ListRegions(pb.ListRegionsRequest(), timeout=10, metadata=metadata)
    outcome["regions_listed"] = str(len(listed.regions))
    print(json.dumps(outcome))


if __name__ == "__main__":
    main()
