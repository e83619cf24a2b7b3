"""The speculation controller as operators see it: --spec-adaptive / --no-spec-adaptive (NEXTN_SPEC_ADAPTIVE),
vLLM's --speculative-config (parsed, and refused naming a method that is not MTP), and through a real uvicorn +
openai client: the K histogram on /metrics, usage.spec.mean_k, the cost table on /health."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from config.settings import ServeSettings, SettingsError, load_settings
from server.cli import build_parser, settings_from_args
from tests.server_fixtures import ServerThread, tiny_checkpoint


def test_flags_env_and_speculative_config(tmp_path):
    ck = str(tiny_checkpoint())
    s = settings_from_args(build_parser().parse_args(["serve", ck]), environ={})
    assert s.spec_adaptive is True and s.spec_schedule == ()  # on by default
    s = settings_from_args(build_parser().parse_args(["serve", ck, "--no-spec-adaptive"]), environ={})
    assert s.spec_adaptive is False
    s = settings_from_args(build_parser().parse_args(["serve", ck]), environ={"NEXTN_SPEC_ADAPTIVE": "false"})
    assert s.spec_adaptive is False
    cfg = '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": ' \
          '{"8": 1, "1": 2}}'
    s = settings_from_args(build_parser().parse_args(["serve", ck, "--speculative-config", cfg]), environ={})
    assert s.num_speculative_tokens == 2 and s.spec_schedule == ((1, 2), (8, 1))  # it wins over the file's K = 3
    s = ServeSettings(model_dir=ck, speculative_config={"method": "mtp", "num_speculative_tokens_per_batch_size":
                                                        [[4, 3], [16, 0]]})
    assert s.num_speculative_tokens == 3 and s.spec_schedule == ((4, 3), (16, 0))


@pytest.mark.parametrize("cfg,needle", [
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "method 'eagle3' is not supported"),
    ('{"method": "mtp", "draft_tensor_parallel_size": 2}', "unsupported key(s) ['draft_tensor_parallel_size']"),
    ('{"num_speculative_tokens_per_batch_size": {"x": 1}}', "must map batch sizes to K"),
    ('{"num_speculative_tokens": 12}', "num_speculative_tokens"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_speculative_config_is_one_line_naming_it(cfg, needle):
    with pytest.raises(SettingsError) as e:
        load_settings({"model_dir": str(tiny_checkpoint()), "speculative_config": cfg}, environ={})
    assert needle in str(e.value) and "\n" not in str(e.value)


def _k_histogram(url: str) -> tuple[dict[str, float], float, float]:
    body = httpx.get(url + "/metrics").text
    fam = {f.name: f for f in text_string_to_metric_families(body)}["nextn_spec_decode_k"]
    le = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    (total,) = [s.value for s in fam.samples if s.name.endswith("_sum")]
    (count,) = [s.value for s in fam.samples if s.name.endswith("_count")]
    return le, total, count


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed"])
def test_k_histogram_mean_k_and_cost_table_through_the_server(adaptive):
    """One request alone: the histogram's increase is that request's rounds (count) and drafts asked (sum), and
    usage.spec.mean_k is their ratio; /health carries the cost table only with the controller on; fixed K asks
    K every round but the last ones (max_tokens)."""
    with ServerThread(num_speculative_tokens=3, spec_adaptive=adaptive) as s:
        health = httpx.get(s.url + "/health").json()
        if adaptive:
            costs = health["spec_cost_ms"]
            assert set(costs) == {"1", "2", "4", "8"} and all(set(t) == {"1", "2", "3", "4"} for t in costs.values())
            assert all(v > 0 for t in costs.values() for v in t.values())
        else:
            assert "spec_cost_ms" not in health
        le0, sum0, n0 = _k_histogram(s.url)
        assert n0 == 0 and set(le0) == {"0.0", "1.0", "2.0", "3.0", "+Inf"}
        r = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0).completions.create(
            model=s.model, prompt=[5, 6, 7, 8], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        spec = r.usage.model_extra["spec"]
        le, total, count = _k_histogram(s.url)
        assert count > 0 and spec["mean_k"] == pytest.approx(total / count, abs=1e-4)
        assert le["+Inf"] == count and le["0.0"] <= le["1.0"] <= le["3.0"] == count
        if not adaptive:
            assert le["2.0"] <= 3 and spec["mean_k"] > 2.5  # K = 3 but in the last rounds before max_tokens (2, 1, 0)
