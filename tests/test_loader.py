"""Loader: layouts and dtype, and an error that names the problem for each failure."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loader import CheckpointError, load_model
from engine.model.config import ConfigError
from tests.tiny import make_checkpoint


@pytest.fixture()
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "m", seed=0, with_tokenizer=False)


def _edit_config(d, **kv):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in kv.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_weights(d, fn):
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"))


def test_layouts_load_the_same_weights(tmp_path):
    a = load_model(make_checkpoint(tmp_path / "a", seed=7, with_tokenizer=False))
    b = load_model(make_checkpoint(tmp_path / "b", seed=7, with_tokenizer=False, layout="vlm", sharded=True))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and any(k.startswith("mtp.") for k in sa)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_dtype_override_and_tied(tmp_path):
    m = load_model(make_checkpoint(tmp_path / "t", seed=1, tie=True, with_tokenizer=False), dtype="bfloat16")
    assert m.lm_head.weight.dtype == torch.bfloat16
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_unsupported_model_type(ckpt):
    _edit_config(ckpt, model_type="llama")
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        load_model(ckpt)


def test_bad_config_field(ckpt):
    _edit_config(ckpt, hidden_size=-3)
    with pytest.raises(ConfigError, match="'hidden_size' must be a positive integer"):
        load_model(ckpt)
    _edit_config(ckpt, hidden_size=64, num_hidden_layers=None)
    with pytest.raises(ConfigError, match="missing required field 'num_hidden_layers'"):
        load_model(ckpt)


def test_bad_layer_types(ckpt):
    _edit_config(ckpt, layer_types=["linear_attention"] * 3)
    with pytest.raises(ConfigError, match="layer_types"):
        load_model(ckpt)


def test_missing_tensor_is_named(ckpt):
    _edit_weights(ckpt, lambda sd: sd.pop("model.layers.2.linear_attn.in_proj_z.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.linear_attn\.in_proj_z\.weight'"):
        load_model(ckpt)


def test_unexpected_shape_names_want_and_got(ckpt):
    def bad(sd):
        sd["model.norm.weight"] = torch.zeros(65)
    _edit_weights(ckpt, bad)
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(65,\), want \(64,\)"):
        load_model(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(ckpt)


def test_missing_shard(tmp_path):
    d = make_checkpoint(tmp_path / "s", seed=0, sharded=True, with_tokenizer=False)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors"):
        load_model(d)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(tmp_path)


def test_mtp_missing_disables_speculation(ckpt, caplog):
    _edit_weights(ckpt, lambda sd: [sd.pop(k) for k in [k for k in sd if k.startswith("mtp.")]])
    m = load_model(ckpt)
    assert m.mtp is None and not m.config.has_mtp
    assert "speculation disabled" in caplog.text


def test_served_model_reads_its_modules_and_weights_without_module_getattr(ckpt, monkeypatch):
    """`fuse` pins submodules and parameters as instance attributes: a decode step never goes through
    nn.Module.__getattr__; a parameter reassigned afterwards is the one the forward uses."""
    from engine.scheduler import Scheduler
    from engine.spec import SpecSession

    m = load_model(ckpt)
    sched = Scheduler(m, max_num_seqs=1, max_model_len=64, k=0, max_num_batched_tokens=64)
    sess = SpecSession(m, [3, 4, 5], 4, k=0, pool=sched.pool)
    sched.add(sess)
    sched.step()
    calls = []
    orig = torch.nn.Module.__getattr__
    monkeypatch.setattr(torch.nn.Module, "__getattr__", lambda self, name: calls.append(name) or orig(self, name))
    sched.step()
    monkeypatch.undo()
    assert sess.error is None and len(sess.emitted) == 2 and calls == []
    h = torch.randn(1, 2, m.config.hidden_size)
    norm = m.model.norm
    before = norm(h)
    norm.weight = torch.nn.Parameter(norm.weight.detach() + 1.0, requires_grad=False)  # drops the pinned copy
    assert norm.weight is norm._parameters["weight"]
    assert not torch.equal(norm(h), before)
