# SPDX-License-Identifier: Apache-2.0
"""grpc's record of a reply to a call that had already ended: one WARNING line, nothing else
touched. The record is made as grpc.aio makes it (its logger, message and exception class):
the race that produces it (a client cancelling while its reply is sent) cannot be pinned."""

from __future__ import annotations

import logging

import pytest
from grpc._cython.cygrpc import ExecuteBatchError

from ibpembed.server.logs import DeadCallReplyFilter, quiet_dead_call_replies

GRPC_LOGGER = logging.getLogger("grpc._cython.cygrpc")


@pytest.fixture
def quieted():
    quiet_dead_call_replies()
    quiet_dead_call_replies()  # once per process, however often called
    yield [f for f in GRPC_LOGGER.filters if isinstance(f, DeadCallReplyFilter)]
    for f in list(GRPC_LOGGER.filters):
        if isinstance(f, DeadCallReplyFilter):
            GRPC_LOGGER.removeFilter(f)


def test_a_reply_to_an_ended_call_is_one_warning_line(quieted, caplog):
    assert len(quieted) == 1
    with caplog.at_level(logging.DEBUG, logger=GRPC_LOGGER.name):
        try:
            raise ExecuteBatchError('Failed "execute_batch": (SendMessageOperation,)')
        except ExecuteBatchError:
            GRPC_LOGGER.exception(
                "ExecuteBatchError raised in core by servicer method [%s]",
                "/ibpembed.v1.EmbeddingLookup/Lookup",
            )
        try:
            raise ValueError("a real problem")
        except ValueError:
            GRPC_LOGGER.exception("Unexpected error in the server")
    demoted, other = caplog.records
    assert demoted.levelno == logging.WARNING and demoted.exc_info is None
    assert demoted.getMessage() == (
        "ExecuteBatchError raised in core by servicer method "
        "[/ibpembed.v1.EmbeddingLookup/Lookup] (the call had already ended: reply dropped)"
    )
    assert "Traceback" not in logging.Formatter().format(demoted)
    assert other.levelno == logging.ERROR and other.exc_info is not None
