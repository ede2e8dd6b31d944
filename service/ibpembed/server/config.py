# SPDX-License-Identifier: Apache-2.0
"""Server configuration: one table of settings, read from flags, environment and a TOML file.

Precedence, highest first: command-line flag, environment variable, config file, default. Every
setting has all three spellings: ``--max-inflight``, ``IBPEMBED_MAX_INFLIGHT``, ``max_inflight``
in the file given by ``--config`` / ``IBPEMBED_CONFIG``. An environment variable set to the
empty string (or blanks) counts as unset, for every setting alike: templated deployments (a
Kubernetes ``env`` from an absent key, ``${VAR:-}``) produce them. :func:`markdown_table`
renders the table the README shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ibpembed.engine_defaults import (
    DEDUPE_MIN_IDS,
    DEFAULT_FORM,
    DEFAULT_TIER,
    FORMS,
    INLINE_MAX_IDS,
)

ENV_PREFIX = "IBPEMBED_"
# gRPC takes message sizes as int32 bytes: 2047 MiB is the most it accepts.
MAX_MESSAGE_MB = 2047
# Names logging.basicConfig accepts (upper-cased); settings are spelt in lower case.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


def _setting(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerConfig:
    """Settings of ``ibpembed serve``. Field comments are the README's table (``help``)."""

    host: str = _setting("127.0.0.1", "Address to listen on; `0.0.0.0` or `[::]` for all.")
    port: int = _setting(50051, "gRPC port; 0 picks a free one (printed at start).")
    metrics_port: int = _setting(9464, "Prometheus exposition port (0 = off).")
    tables: str | None = _setting(
        None, "Packed table-set directory; unset serves the embedded demo table set."
    )
    verify_payloads: bool = _setting(
        False,
        "Hash every payload byte against its checksum at load and at each reload (reads the"
        " whole table set; without it header, index and metadata are checked, payloads by"
        " `ibpembed verify`).",
    )
    prefetch_payloads: bool = _setting(
        True,
        "At load and at each reload, have the kernel read every payload into the page cache"
        " before serving it, so the first lookups after a start do not each wait on storage"
        " (from a cold cache the load then takes about as long as reading the table set).",
    )
    keep_versions: int = _setting(
        2,
        "Published table-set versions kept and served on request (`LookupRequest.table_version`),"
        " the newest included; a reload drops the oldest. Memory: tables an older version does"
        " not share with the newest stay resident (`ibpembed_table_set_older_versions_bytes`).",
    )
    reload_poll_s: float = _setting(
        10.0,
        "Seconds between checks of the table set's manifest: a new one (`ibpembed pack` into"
        " the directory) is loaded and published live; SIGHUP reloads at once (0 = SIGHUP only).",
    )
    device: str = _setting(
        "auto",
        "Where kernels run: `cpu`, `cuda` or `auto`. On a GPU node a startup self-test decodes"
        " a sample of every table on the GPU and compares it bit for bit with the CPU first:"
        " `auto` uses CUDA only when it passes (else serves on the CPU and logs an error),"
        " `cuda` exits non-zero when it fails.",
        choices=("cpu", "cuda", "auto"),
    )
    workers: int = _setting(min(4, os.cpu_count() or 1), "Threads running lookup kernels.")
    torch_threads: int = _setting(
        1,
        "torch intra-op threads per kernel call. 1 = parallelism comes from `workers`"
        " (more threads per call oversubscribe the cores: torch.unique got 10x slower).",
    )
    max_inflight: int = _setting(
        64,
        "Lookups admitted at once (running or waiting for a worker); more get"
        " RESOURCE_EXHAUSTED. Also the LookupStream requests read and not yet answered, all"
        " streams together (one caller's at most half, or one `stream_window` if more): a full"
        " backlog stops a stream reading.",
    )
    max_message_mb: int = _setting(
        64,
        "Max gRPC message size, MiB, both directions. A B=2048 DCNv2-profile pooled response"
        " is ~27 MB.",
    )
    stream_window: int = _setting(
        8,
        "Requests of one LookupStream running or waiting to be written at once (responses"
        " stay in order).",
    )
    stream_write_timeout_s: float = _setting(
        30.0,
        "Seconds a LookupStream response may wait for its client to read it; then the server"
        " cancels the stream and frees what it held (the client, not reading, learns nothing"
        " until its own deadline or keepalive).",
    )
    grace_s: float = _setting(
        20.0,
        "On SIGTERM/SIGINT: seconds in-flight RPCs, and a table-set reload in progress, get to"
        " finish; then RPCs are cancelled and the reload abandoned.",
    )
    dedupe_max_unique_fraction: float = _setting(
        0.5,
        "A table's pooled lookups of >= `dedupe_min_ids` ids (in one request) sort them and"
        " decode distinct rows once when distinct/ids <= this (0 = never).",
    )
    dedupe_min_ids: int = _setting(
        DEDUPE_MIN_IDS,
        "Ids of one table in one request from which pooled lookups consider sorting them (see"
        " `dedupe_max_unique_fraction`); smaller lookups decode most repeats once through the"
        " kernel's bounded per-call cache of decoded rows.",
    )
    inline_max_ids: int = _setting(
        INLINE_MAX_IDS,
        "CPU requests with at most this many ids run on the event loop's thread instead of a"
        " worker (their kernels are shorter than the hand-off; 0 = always a worker).",
    )
    hot_tier: str = _setting(
        DEFAULT_TIER,
        "Host memory per table for its decoded hot tier (most looked-up rows, chosen online),"
        " read by CPU lookups instead of decoding: `N%` of its raw bytes, `savings` or"
        " `N%savings` (of raw - stored bytes: `savings` keeps each table within its raw bytes),"
        " bytes for the whole set split by raw size (`512MiB`, `2GB`), `all` (every row) or"
        " `0`/`off`; a budget past the whole table is `all`.",
    )
    hot_tier_refresh_s: float = _setting(
        30.0, "Seconds between publications of changed hot tiers (built aside, swapped in)."
    )
    hbm_tier: str = _setting(
        "off",
        "GPU only: GPU memory per table for its HBM tier (most looked-up rows, chosen by the"
        " hot tier's policy), read by the kernels from HBM instead of over PCIe; the"
        " `hot_tier` spellings (`5%` of raw bytes, `2GiB` for the set, `all`, `off`).",
    )
    hbm_tier_form: str = _setting(
        DEFAULT_FORM,
        "GPU only: HBM tier rows stored `decoded` (no decode on a hit) or `compressed` (more"
        " rows in the same bytes); a GPU measurement decides the default.",
        choices=FORMS,
    )
    malloc_retain_mb: int = _setting(
        256,
        "glibc: MiB of freed memory kept for reuse, so multi-MB responses are not mapped and"
        " page-faulted anew per request (0 = glibc's defaults).",
    )
    demo_max_rows: int = _setting(
        20000, "Demo table set only: rows per table cap (DCNv2 cardinalities are capped to it)."
    )
    tls_cert: str | None = _setting(None, "PEM server certificate chain; enables TLS.")
    tls_key: str | None = _setting(None, "PEM private key for `tls_cert`.")
    tls_client_ca: str | None = _setting(
        None, "PEM CA bundle; when set clients must present a certificate it signed (mTLS)."
    )
    auth_token_file: str | None = _setting(
        None,
        "File holding the bearer token clients must send (`authorization: Bearer ...`);"
        " its callers share the identity `token`.",
    )
    auth_tokens_file: str | None = _setting(
        None,
        "File of bearer tokens, one `<identity> <token>` a line (`#` comments): each token is"
        " its own identity, whose shared-memory regions no other identity can see, use or"
        " release. Without any token file every caller is one identity, `anonymous`.",
    )
    max_regions: int = _setting(
        512,
        "Shared-memory regions registered at once, all callers together (each holds a file"
        " descriptor; one identity holds at most 256).",
    )
    reflection: bool = _setting(True, "Register gRPC server reflection (for grpcurl).")
    log_level: str = _setting(
        "info",
        "Python log level: `debug`, `info`, `warning`, `error` or `critical`.",
        choices=LOG_LEVELS,
    )
    log_format: str = _setting(
        "text",
        "Log lines as `text` or `json` (one object a line: time, level, logger, message;"
        " for Loki, Cloud Logging, Elastic). The banner stays text on stdout, and gRPC's own"
        " C-core lines (`GRPC_VERBOSITY`) stay text on stderr.",
        choices=LOG_FORMATS,
    )

    def validate(self) -> ServerConfig:
        """Raise ValueError for impossible combinations; returns self."""
        for f in _fields():
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")
        if not 0 <= self.port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise ValueError("ports must be in [0, 65535]")
        for name in (
            "workers",
            "torch_threads",
            "max_inflight",
            "max_message_mb",
            "stream_window",
            "max_regions",
            "keep_versions",
            "dedupe_min_ids",
            "demo_max_rows",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_message_mb > MAX_MESSAGE_MB:
            raise ValueError(
                f"max_message_mb must be <= {MAX_MESSAGE_MB} (gRPC sizes are int32), "
                f"got {self.max_message_mb}"
            )
        for name in (
            "grace_s",
            "stream_write_timeout_s",
            "reload_poll_s",
            "dedupe_max_unique_fraction",
            "hot_tier_refresh_s",
        ):
            if not math.isfinite(getattr(self, name)):  # nan passes every comparison below
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        # Imported here: the budget parser lives beside the codec (torch), which `serve --help`
        # and the settings table need none of.
        from ibpembed.tables.tier_budget import TierBudget

        try:
            TierBudget.parse(self.hot_tier)
        except ValueError as exc:
            raise ValueError(f"hot_tier: {exc}") from None
        try:
            TierBudget.parse(self.hbm_tier, setting="hbm tier")
        except ValueError as exc:
            raise ValueError(f"hbm_tier: {exc}") from None
        if not 0 <= self.dedupe_max_unique_fraction <= 1:
            raise ValueError(
                "dedupe_max_unique_fraction must be in [0, 1], "
                f"got {self.dedupe_max_unique_fraction}"
            )
        if self.inline_max_ids < 0:
            raise ValueError(f"inline_max_ids must be >= 0, got {self.inline_max_ids}")
        if self.hot_tier_refresh_s <= 0:
            raise ValueError(f"hot_tier_refresh_s must be > 0, got {self.hot_tier_refresh_s}")
        if self.stream_write_timeout_s <= 0:
            raise ValueError(
                f"stream_write_timeout_s must be > 0, got {self.stream_write_timeout_s}"
            )
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.reload_poll_s < 0:
            raise ValueError(f"reload_poll_s must be >= 0, got {self.reload_poll_s}")
        if self.malloc_retain_mb < 0:
            raise ValueError(f"malloc_retain_mb must be >= 0, got {self.malloc_retain_mb}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        return self

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


def _fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(ServerConfig))


def _kind(f: dataclasses.Field) -> type:
    """The scalar type of a field (``str | None`` -> str)."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    return {"str": str, "int": int, "float": float, "bool": bool}[kind.split(" ")[0]]


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _choice(text: str) -> str:
    """Settings with choices are spelt in lower case; any case is accepted."""
    return text.strip().lower()


def _check_file_value(f: dataclasses.Field, value: Any, source: str) -> None:
    """A config file's numbers must be TOML numbers of the setting's kind: ``int()`` would
    truncate ``port = 52315.9`` to 52315 and turn ``workers = true`` into 1."""
    kind = _kind(f)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(
            f"{source}: {f.name} must be an integer, got {value!r} ({type(value).__name__})"
        )
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValueError(
            f"{source}: {f.name} must be a number, got {value!r} ({type(value).__name__})"
        )


def _convert(f: dataclasses.Field, value: Any, source: str, *, from_file: bool = False) -> Any:
    if from_file:
        _check_file_value(f, value, source)
    kind = _kind(f)
    try:
        if kind is bool:
            return value if isinstance(value, bool) else _parse_bool(str(value))
        converted = kind(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {f.name}: {exc}") from None
    if "choices" in f.metadata:
        converted = _choice(converted)
        if converted not in f.metadata["choices"]:
            raise ValueError(
                f"{source}: {f.name} must be one of {f.metadata['choices']}, got {value!r}"
            )
    return converted


def _shown_default(f: dataclasses.Field) -> str:
    if f.name == "workers":
        return "min(4, CPUs)"
    if f.default is None:
        return "unset"
    return str(f.default).lower() if isinstance(f.default, bool) else str(f.default)


def flag_help(f: dataclasses.Field) -> str:
    """A setting's ``--help`` line: the README's text without its markup, then the environment
    variable and the default (argparse's %-formatting escaped)."""
    text = f.metadata["help"].replace("`", "")
    return f"{text} (env {ENV_PREFIX}{f.name.upper()}; default {_shown_default(f)})".replace(
        "%", "%%"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (defaults left None so unset flags fall through to env and file)."""
    parser.add_argument(
        "--config", default=None, help=f"TOML config file (env {ENV_PREFIX}CONFIG; default unset)."
    )
    for f in _fields():
        flag = "--" + f.name.replace("_", "-")
        if _kind(f) is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=flag_help(f)
            )
        else:
            parser.add_argument(
                flag,
                type=_choice if "choices" in f.metadata else _kind(f),
                default=None,
                help=flag_help(f),
                choices=f.metadata.get("choices"),
            )


def _read_file(path: str) -> dict[str, Any]:
    import tomllib  # Python >= 3.11; imported here so 3.10 runs without config files

    with open(path, "rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:  # its message has the line, not the file
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
    known = {f.name for f in _fields()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
    return data


def load(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Merge flags (``args`` from :func:`add_arguments`), ``environ`` and the config file."""
    environ = {
        name: value
        for name, value in (os.environ if environ is None else environ).items()
        if name.startswith(ENV_PREFIX) and value.strip()
    }
    flags = vars(args) if args is not None else {}
    config_path = flags.get("config") or environ.get(f"{ENV_PREFIX}CONFIG")
    from_file = _read_file(config_path) if config_path else {}
    values: dict[str, Any] = {}
    for f in _fields():
        env_name = ENV_PREFIX + f.name.upper()
        if flags.get(f.name) is not None:
            values[f.name] = flags[f.name]
        elif env_name in environ:
            values[f.name] = _convert(f, environ[env_name], env_name)
        elif f.name in from_file:
            values[f.name] = _convert(f, from_file[f.name], str(config_path), from_file=True)
    return ServerConfig(**values).validate()


def markdown_table() -> str:
    """The settings table for the README."""
    lines = [
        "| flag | environment | config key | default | meaning |",
        "|---|---|---|---|---|",
        f"| `--config` | `{ENV_PREFIX}CONFIG` | — | — | TOML file setting any key below. |",
    ]
    for f in _fields():
        default = "—" if f.default is None else f"`{f.default}`"
        if isinstance(f.default, bool):
            default = f"`{str(f.default).lower()}`"
        if f.name == "workers":
            default = "min(4, CPUs)"
        lines.append(
            f"| `--{f.name.replace('_', '-')}` | `{ENV_PREFIX}{f.name.upper()}` | `{f.name}` "
            f"| {default} | {f.metadata['help']} |"
        )
    return "\n".join(lines)
