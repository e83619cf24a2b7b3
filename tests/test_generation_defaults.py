"""The checkpoint's generation_config.json as request defaults (vLLM's --generation-config / --override-generation-config).

Two real servers on the tiny checkpoint: one whose generation config sets top_k = 1 and max_new_tokens = 6
(`--generation-config DIR`), one with `--generation-config vllm` (the built-in defaults). A request that leaves
sampling unset is greedy on the first (top_k 1 keeps only the most likely token) and samples on the second; a
request's own values win on either; temperature 0 stays the greedy path.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from config.settings import SettingsError, load_settings
from engine.gen_defaults import GenerationConfigError, GenerationDefaults, load_generation_defaults
from server.cli import build_parser, settings_from_args
from tests.server_fixtures import ServerThread

MSGS = [{"role": "user", "content": "Tell me a story about a fox."}]
N_TOKENS = 12


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gen")
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 1, "max_new_tokens": 6,
                                                          "eos_token_id": [1, 2], "transformers_version": "5"}))
    return d


@pytest.fixture(scope="module")
def greedy_by_default(gen_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(generation_config=str(gen_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def builtin(greedy_by_default: ServerThread) -> Iterator[ServerThread]:
    with ServerThread(generation_config="vllm") as s:
        yield s


def client(s: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)


def ids(s: ServerThread, **kw) -> list[list[int]]:
    """Each choice's token ids for a completion of N_TOKENS (EOS ignored), with `kw` as the request's own fields."""
    extra = {"return_token_ids": True, "ignore_eos": True, **kw.pop("extra_body", {})}
    r = client(s).completions.create(model=s.model, prompt="Once upon a time", max_tokens=N_TOKENS, extra_body=extra,
                                     **kw)
    return [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)]


def test_unset_sampling_follows_the_checkpoint_top_k_1(greedy_by_default, builtin):
    greedy = ids(greedy_by_default, temperature=0)[0]
    assert len(greedy) == N_TOKENS
    assert ids(builtin, temperature=0)[0] == greedy  # the same model: temperature 0 is greedy on both
    # unset temperature (1.0) with the checkpoint's top_k 1: every choice is the greedy one
    assert ids(greedy_by_default, n=3, seed=7) == [greedy] * 3
    # --generation-config vllm: the same request samples the whole distribution
    sampled = ids(builtin, n=3, seed=7)
    assert any(c != greedy for c in sampled)
    # the request's own top_k wins over the checkpoint's: the same seeds give the same samples as without defaults
    assert ids(greedy_by_default, n=3, seed=7, extra_body={"top_k": 0}) == sampled
    # temperature 0 stays the greedy path with defaults in force
    assert ids(greedy_by_default, temperature=0, extra_body={"top_k": 0}) == [greedy]


def test_max_new_tokens_is_the_default_max_tokens(greedy_by_default, builtin):
    c = client(greedy_by_default)
    r = c.chat.completions.create(model=greedy_by_default.model, messages=MSGS, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6  # the checkpoint's max_new_tokens
    r = c.chat.completions.create(model=greedy_by_default.model, messages=MSGS, max_tokens=9,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 9  # the request's own wins
    r = c.completions.create(model=greedy_by_default.model, prompt="Hi", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6  # completions: min(its default 16, max_new_tokens), as vLLM
    r = client(builtin).completions.create(model=builtin.model, prompt="Hi", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_load_rules(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None, "repetition_penalty": 1.05, "do_sample": True}))
    d = load_generation_defaults("auto", tmp_path)
    assert d.values() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    assert str(tmp_path / "generation_config.json") in d.describe() and "temperature=0.6" in d.describe()
    assert load_generation_defaults("vllm", tmp_path).values() == {}
    over = load_generation_defaults("auto", tmp_path, {"temperature": 0.0, "max_new_tokens": 64})
    assert over.temperature == 0.0 and over.max_tokens == 64 and over.top_k == 20 and "override" in over.source
    assert load_generation_defaults("vllm", tmp_path, {"top_k": 5}).values() == {"top_k": 5}
    assert load_generation_defaults("auto", tmp_path / "none").values() == {}  # no file: no defaults
    for mode, override, needle in ((str(tmp_path / "none"), None, "no generation_config.json there"),
                                   ("auto", {"temprature": 1}, "unknown field(s) ['temprature']"),
                                   ("auto", {"top_p": 0}, "top_p 0 is out of range"),
                                   ("auto", {"top_k": 1.5}, "top_k 1.5 is out of range")):
        with pytest.raises(GenerationConfigError, match=re.escape(needle)):
            load_generation_defaults(mode, tmp_path, override)
    assert GenerationDefaults().describe().startswith("generation defaults: none")


def test_flags_env_and_startup_log(tmp_path, gen_dir, caplog):
    args = build_parser().parse_args(["serve", str(tmp_path), "--generation-config", "vllm",
                                      "--override-generation-config", '{"temperature": 0.5}',
                                      "--served-model-name", "a", "b", "c"])
    s = settings_from_args(args, environ={})
    assert s.generation_config == "vllm" and s.override_generation_config == {"temperature": 0.5}
    assert s.served_model_name == "a" and s.served_model_aliases == ("b", "c")
    s = load_settings({"model_dir": tmp_path}, environ={"NEXTN_OVERRIDE_GENERATION_CONFIG": '{"top_k": 2}',
                                                        "NEXTN_SERVED_MODEL_ALIASES": "x y"})
    assert s.override_generation_config == {"top_k": 2} and s.served_model_aliases == ("x", "y")
    with pytest.raises(SettingsError, match="NEXTN_OVERRIDE_GENERATION_CONFIG"):
        load_settings({"model_dir": tmp_path}, environ={"NEXTN_OVERRIDE_GENERATION_CONFIG": "{top_k"})
    with caplog.at_level(logging.INFO, logger="nextn"), ServerThread(generation_config=str(gen_dir),
                                                                      override_generation_config={"top_p": 0.9},
                                                                      served_model_aliases=("alias",)) as srv:
        c = client(srv)
        assert c.completions.create(model="alias", prompt="Hi", max_tokens=1).model == srv.model
        assert [m.id for m in c.models.list().data] == [srv.model, "alias"]  # vLLM lists every served name
        assert c.models.retrieve("alias").id == "alias"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("generation defaults"))
    assert "top_k=1" in line and "top_p=0.9" in line and "max_tokens=6" in line and str(gen_dir) in line
