# SPDX-License-Identifier: Apache-2.0
"""Settings from flags, environment and a TOML file, in that order of precedence."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from ibpembed.server import config


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_match_the_issue():
    cfg = config.load(_args(), environ={})
    assert (cfg.host, cfg.port, cfg.metrics_port, cfg.tables, cfg.device) == (
        "127.0.0.1", 50051, 9464, None, "auto",
    )  # fmt: skip
    # Large enough for a B=2048 x 26 x 128 fp32 pooled response (~27 MB).
    assert cfg.max_message_bytes > 2048 * 26 * 128 * 4


def test_flag_beats_env_beats_file(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text("port = 1111\nmax_inflight = 5\nworkers = 3\nreflection = false\n")
    env = {"IBPEMBED_PORT": "2222", "IBPEMBED_MAX_INFLIGHT": "6"}
    cfg = config.load(_args("--config", str(path), "--port", "3333"), environ=env)
    assert (cfg.port, cfg.max_inflight, cfg.workers, cfg.reflection) == (3333, 6, 3, False)
    cfg = config.load(_args(), environ={**env, "IBPEMBED_CONFIG": str(path)})
    assert (cfg.port, cfg.max_inflight) == (2222, 6)
    assert config.load(_args("--no-reflection"), environ={}).reflection is False


def test_an_empty_environment_variable_counts_as_unset(tmp_path):
    """Every setting alike: no empty token, no empty tables path, no int("") error; the file's
    value shows through."""
    path = tmp_path / "server.toml"
    path.write_text("port = 1111\n")
    env = {f"IBPEMBED_{f.name.upper()}": " " for f in dataclasses.fields(config.ServerConfig)}
    cfg = config.load(_args("--config", str(path)), environ=env)
    assert cfg == dataclasses.replace(config.load(_args(), environ={}), port=1111)
    assert config.load(_args(), environ={"IBPEMBED_CONFIG": "", "IBPEMBED_PORT": "2"}).port == 2


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (("--port", "70000"), {}, "ports"),
        (("--max-inflight", "0"), {}, "max_inflight"),
        (("--tls-cert", "x.pem"), {}, "tls_key"),
        (("--tls-client-ca", "ca.pem"), {}, "mTLS"),
        ((), {"IBPEMBED_WORKERS": "many"}, "IBPEMBED_WORKERS"),
        ((), {"IBPEMBED_DEVICE": "tpu"}, "device"),
        ((), {"IBPEMBED_REFLECTION": "maybe"}, "boolean"),
        ((), {"IBPEMBED_HOT_TIER_REFRESH_S": "nan"}, "hot_tier_refresh_s must be a finite"),
        ((), {"IBPEMBED_HOT_TIER_REFRESH_S": "inf"}, "hot_tier_refresh_s must be a finite"),
        (("--grace-s", "nan"), {}, "grace_s must be a finite"),
        (("--max-message-mb", "2048"), {}, "int32"),
        (("--malloc-retain-mb", "-1"), {}, "malloc_retain_mb must be >= 0"),
        ((), {"IBPEMBED_DEDUPE_MIN_IDS": "0"}, "dedupe_min_ids must be >= 1"),
        (("--reload-poll-s", "-1"), {}, "reload_poll_s must be >= 0"),
        (("--inline-max-ids", "-1"), {}, r"inline_max_ids must be >= 0, got -1"),
        (
            ("--dedupe-max-unique-fraction", "2"),
            {},
            r"dedupe_max_unique_fraction must be in \[0, 1\]",
        ),
        (
            (),
            {"IBPEMBED_DEDUPE_MAX_UNIQUE_FRACTION": "-0.1"},
            "dedupe_max_unique_fraction must be in",
        ),
        (("--reload-poll-s", "nan"), {}, "reload_poll_s must be a finite"),
        (("--hbm-tier=-5%",), {}, "hbm_tier: .*negative"),
        ((), {"IBPEMBED_HBM_TIER": "lots"}, "hbm_tier: .*not one of"),
        ((), {"IBPEMBED_HBM_TIER_FORM": "raw"}, "hbm_tier_form must be one of"),
        ((), {"IBPEMBED_HOT_TIER": "0.05"}, "hot_tier: .*a share is written with a percent"),
        (("--hot-tier", "0.05"), {}, "hot_tier: .*fraction of a byte"),
    ],
)
def test_invalid_settings_are_named(argv, env, message):
    with pytest.raises(ValueError, match=message):
        config.load(_args(*argv), environ=env)


def test_the_hbm_tier_is_off_and_decoded_by_default_and_takes_the_hot_tier_spellings():
    cfg = config.load(_args(), environ={})
    assert (cfg.hbm_tier, cfg.hbm_tier_form) == ("off", "decoded")
    cfg = config.load(_args("--hbm-tier", "5%", "--hbm-tier-form", "compressed"), environ={})
    assert (cfg.hbm_tier, cfg.hbm_tier_form) == ("5%", "compressed")
    assert config.load(_args(), environ={"IBPEMBED_HBM_TIER": "2GiB"}).hbm_tier == "2GiB"


def test_log_level_has_choices():
    assert config.load(_args("--log-level", "DEBUG"), environ={}).log_level == "debug"
    assert config.load(_args(), environ={"IBPEMBED_LOG_LEVEL": "Warning"}).log_level == "warning"
    with pytest.raises(SystemExit):  # argparse: "invalid choice", exit code 2
        _args("--log-level", "verbose")
    with pytest.raises(ValueError, match="IBPEMBED_LOG_LEVEL: log_level must be one of"):
        config.load(_args(), environ={"IBPEMBED_LOG_LEVEL": "verbose"})
    with pytest.raises(ValueError, match="log_level must be one of"):
        config.ServerConfig(log_level="verbose").validate()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("port = 52315.9", r"port must be an integer, got 52315\.9 \(float\)"),
        ("port = 52315.0", "port must be an integer"),
        ("workers = true", r"workers must be an integer, got True \(bool\)"),
        ('max_inflight = "8"', "max_inflight must be an integer"),
        ("grace_s = true", "grace_s must be a number"),
        ('grace_s = "5"', "grace_s must be a number"),
    ],
)
def test_config_file_numbers_must_be_numbers_of_the_right_kind(tmp_path, line, message):
    path = tmp_path / "server.toml"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=rf"{path}: {message}"):
        config.load(_args("--config", str(path)), environ={})


def test_a_share_written_as_a_toml_float_is_refused_not_read_as_bytes(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text("hot_tier = 0.05\n")
    with pytest.raises(ValueError, match=r"hot_tier: .*fraction of a byte"):
        config.load(_args("--config", str(path)), environ={})


def test_a_config_file_that_is_not_toml_is_named(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text("port = 1\nworkers =\n")
    with pytest.raises(ValueError, match=rf"^{path}: not valid TOML: .*line 2"):
        config.load(_args("--config", str(path)), environ={})


def test_config_file_int_and_float_settings(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text("port = 52315\ngrace_s = 5\nreload_poll_s = 0.5\n")
    cfg = config.load(_args("--config", str(path)), environ={})
    assert (cfg.port, cfg.grace_s, cfg.reload_poll_s) == (52315, 5.0, 0.5)
    assert isinstance(cfg.grace_s, float)


def test_documented_table_is_the_generated_one():
    """docs/server.md's settings table is config.markdown_table(), row for row (paste it when a
    setting changes)."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()

    def rows(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("| `--")]

    assert rows(readme) == rows(config.markdown_table())


def test_markdown_table_lists_every_setting():
    table = config.markdown_table()
    for name in ("--max-message-mb", "IBPEMBED_GRACE_S", "`auth_token_file`", "min(4, CPUs)"):
        assert name in table
