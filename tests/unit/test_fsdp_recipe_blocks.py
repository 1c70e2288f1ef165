"""recipes/finetune_llm_fsdp.py: which modules become FSDP units (no process group needed), and the
config and flags refused before training."""

import json
import os

import pytest
import torch

from recipes import common
from recipes.finetune_llm_fsdp import MIXED_PRECISION, _shared_outside, find_blocks, load_config, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "configs", "models")


@pytest.fixture(scope="module")
def tied():
    return common.build_model(os.path.join(MODELS, "llama-tiny-tied.json"), vocab_size=64)


def test_blocks_come_from_no_split_modules_or_the_config(tied):
    blocks, source = find_blocks(tied)
    assert blocks == list(tied.model.layers) and source == "_no_split_modules ['LlamaDecoderLayer']"
    blocks, source = find_blocks(tied, ["LlamaMLP"])
    assert blocks == [layer.mlp for layer in tied.model.layers] and source == "fsdp.blocks ['LlamaMLP']"
    with pytest.raises(common.ConfigError, match=r"fsdp.blocks \(\['Nope'\]\) must name classes of the model's "
                                                 r"modules: \[.*'LlamaDecoderLayer'"):
        find_blocks(tied, ["Nope"])


def test_a_model_without_no_split_modules_falls_back_to_its_longest_module_list():
    class Net(torch.nn.Module):
        _no_split_modules = None

        def __init__(self):
            super().__init__()
            self.short = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])

    net = Net()
    blocks, source = find_blocks(net)
    assert blocks == list(net.layers) and "the longest ModuleList layers (Net names no _no_split_modules" in source
    with pytest.raises(common.ConfigError, match="names no _no_split_modules and has no ModuleList of blocks: set "
                                                 "fsdp.blocks"):
        find_blocks(torch.nn.Linear(2, 2))


def test_a_tied_embedding_is_shared_outside_its_module(tied):
    untied = common.build_model(os.path.join(MODELS, "llama-tiny-untied.json"), vocab_size=64)
    assert _shared_outside(tied.get_input_embeddings(), tied)
    assert not _shared_outside(untied.get_input_embeddings(), untied)
    assert not _shared_outside(tied.model.layers[0], tied)


def test_flags_and_config_are_checked_before_training(tmp_path):
    args = parse_args(["--config", "c.json", "--mixed_precision", "bf16", "--activation_checkpointing",
                       "--cpu_offload", "--catch_up_adam", "--save_every", "5", "--resume"])
    assert (args.mixed_precision, args.activation_checkpointing, args.cpu_offload, args.catch_up_adam,
            args.save_every, args.resume) == ("bf16", True, True, True, 5, True)
    assert MIXED_PRECISION["bf16"] == (torch.bfloat16, torch.float32)
    assert MIXED_PRECISION["bf16-reduce-bf16"] == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(SystemExit):
        parse_args(["--config", "c.json", "--mixed_precision", "fp16"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fsdp": {"blocks": "LlamaDecoderLayer"}}))
    with pytest.raises(common.ConfigError, match=r"fsdp.blocks \('LlamaDecoderLayer'\) must be null or a non-empty "
                                                 r"list of class names"):
        load_config(str(bad))


def test_the_warm_up_keys_are_read_and_checked(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"fsdp": {"warmup_steps": 10, "warmup_type": "linear"}}))
    fsdp, zen = load_config(str(good))
    assert (fsdp["warmup_steps"], fsdp["warmup_type"], zen) == (10, "linear", None)
    assert load_config(os.path.join(ROOT, "configs", "fsdp2_dense.json"))[0]["warmup_steps"] == 0  # default: none
    for value, rule in ((-1, r"fsdp.warmup_steps \(-1\) must be an integer >= 0"),
                        (2.5, r"fsdp.warmup_steps \(2.5\) must be an integer >= 0")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"fsdp": {"warmup_steps": value}}))
        with pytest.raises(common.ConfigError, match=rule):
            load_config(str(bad))
    bad.write_text(json.dumps({"fsdp": {"warmup_type": "cosine"}}))
    with pytest.raises(common.ConfigError, match=r"fsdp.warmup_type \('cosine'\) must be one of \['log', 'linear'\]"):
        load_config(str(bad))
