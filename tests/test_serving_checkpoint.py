"""A training checkpoint as the served model: its model (workload, preset, overrides) taken from its
description, its parameters restored into the decode path; a checkpoint of another model refused
with the field named, through the config layer and the command line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from migration.cli.commands import main
from migration.common import ConfigError
from migration.config.requests import CHECKPOINT_META_FILE
from migration.config.serving import serve_request, serve_run_request
from migration.running.checkpoint import restore_params
from migration.running.serving import serve_run
from tests.conftest import served_and_greedy
from workloads.transformer import Decoder


def test_the_checkpoints_model_is_planned(trained_llama_checkpoint):
    req = serve_request(workload=None, preset=None, target="l4", prompt_len=16, gen_len=16,
                        checkpoint=str(trained_llama_checkpoint))
    assert (req.workload, req.preset, req.model) == ("llama", "tiny", {"tied_embeddings": False})
    same = serve_request(workload="llama", preset="tiny", target="l4", prompt_len=16, gen_len=16,
                         checkpoint=str(trained_llama_checkpoint))
    assert same == req


@pytest.mark.parametrize("named", [dict(workload="transformer"), dict(preset="1b"),
                                   dict(workload="transformer", preset="tiny")])
def test_a_checkpoint_of_another_model_is_refused_naming_the_field(trained_llama_checkpoint, named):
    given = dict(workload=None, preset=None) | named
    for build in (lambda: serve_request(**given, target="l4", prompt_len=16, gen_len=16,
                                        checkpoint=str(trained_llama_checkpoint)),
                  lambda: serve_run_request(**given, checkpoint=str(trained_llama_checkpoint))):
        with pytest.raises(ConfigError) as info:
            build()
        assert info.value.field == "checkpoint" and "another model: llama/tiny" in str(info.value), str(info.value)


def test_a_checkpoint_without_a_decode_path_or_no_checkpoint_is_refused(trained_llama_checkpoint, tmp_path):
    mlp = tmp_path / "mlp"
    shutil.copytree(trained_llama_checkpoint, mlp)
    meta = json.loads((mlp / CHECKPOINT_META_FILE).read_text())
    (mlp / CHECKPOINT_META_FILE).write_text(json.dumps(meta | {"workload": "mlp"}))
    cases = [(str(mlp), "has no decode path"), (str(tmp_path), "not a checkpoint folder"),
             ("relative/ckpt", "absolute path"), ("/nowhere/\n", "absolute path")]
    for folder, words in cases:
        with pytest.raises(ConfigError) as info:
            serve_run_request(workload=None, preset=None, checkpoint=folder)
        assert info.value.field == "checkpoint" and words in str(info.value), str(info.value)


def test_served_tokens_are_the_trained_models_greedy_continuations(trained_llama_checkpoint):
    cfg, params, meta = restore_params(trained_llama_checkpoint)
    assert meta.step == 4 and not cfg.tied_embeddings
    served, expected = served_and_greedy(cfg, params, Decoder, [[3, 1, 4, 1, 5], [9, 2, 6]], [6, 4])
    assert served == expected


def test_a_run_of_the_checkpoint_checks_int8_on_the_trained_weights(trained_llama_checkpoint):
    req = serve_run_request(workload=None, preset=None, precision="int8", requests=6, batches="2",
                            checkpoint=str(trained_llama_checkpoint))
    result = serve_run(req)
    check = result["logits_check"]
    assert result["weights"] == "checkpoint" and result["recompiles"] == 0
    assert check["within"] and 0 < check["rms_ratio"] <= check["tolerance"]
    assert np.isfinite(result["rows"][0]["tpot_p50_s"])


def test_the_command_line_refuses_another_models_checkpoint_in_one_line(trained_llama_checkpoint, capsys):
    code = main(["serve-plan", "--workload", "transformer", "--preset", "tiny", "--checkpoint",
                 str(trained_llama_checkpoint), "--target", "l4", "--prompt-len", "8", "--gen-len", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "checkpoint: the checkpoint is of another model" in err and "Traceback" not in err
    code = main(["serve-run", "--preset", "1b", "--checkpoint", str(trained_llama_checkpoint)])
    err = capsys.readouterr().err
    assert code == 2 and "checkpoint:" in err and err.count("\n") == 1
