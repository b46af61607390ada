"""The drafter trainers' CLIs end to end on a tiny target: train, checkpoint, resume, save, load."""

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark_kernels.drafters import load_drafter
from dspark_kernels.engine.speculative import speculative_generate
from dspark_kernels.models import load_model
from dspark_kernels.train import chain_drafter as chain_cli
from dspark_kernels.train import drafter as block_cli
from dspark_kernels.train.rollouts import Rollouts, save_rollouts


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("cli")
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    Qwen3ForCausalLM(cfg).save_pretrained(root / "target")
    rng = random.Random(0)
    ro = Rollouts([[1, rng.randrange(4, 64)] for _ in range(6)],
                  [[rng.randrange(4, 64) for _ in range(30)] for _ in range(6)], [1.0] * 6, [0] * 6)
    save_rollouts(ro, root / "rollouts", "train")
    return root


def run_argv(setup, name: str, work: Path, out: Path, *more: str) -> list[str]:
    """A trainer's command line on this module's tiny target and rollouts: ``work``/``out`` directories, batch 2."""
    return ["--name", name, "--target", str(setup / "target"), "--rollouts", str(setup / "rollouts"), "--work-dir",
            str(work), "--out", str(out), "--batch-size", "2", *more]


@pytest.mark.parametrize("name,cli,extra", [
    ("dspark", block_cli, ["--rank", "8", "--gammas", "3", "5", "--anchors", "4", "--feature-layers", "0", "2"]),
    ("dflash", block_cli, ["--loss", "dflash", "--rank", "0", "--gammas", "3", "--anchors", "4",
                           "--feature-layers", "1"]),
    ("eagle", chain_cli, ["--steps-unroll", "2"]),
    ("mtp1", chain_cli, []),
])
def test_train_resume_save_load(setup, name, cli, extra, capsys):
    common = run_argv(setup, name, setup / "runs" / name, setup / "out" / name, "--ckpt-every", "1", *extra)
    cli.main(common + ["--steps", "2", "--resume"])  # nothing to resume yet: starts at step 0 and says so
    assert "--resume: no checkpoint at" in capsys.readouterr().err
    cli.main(common + ["--steps", "3", "--resume"])
    assert "no checkpoint" not in capsys.readouterr().err
    log = [json.loads(line) for line in (setup / "runs" / name / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]  # resumed at step 2, did one more
    summary = json.loads((setup / "out" / name / "train_summary.json").read_text())
    assert summary["steps"] == 3
    target = load_model(setup / "target")
    drafter = load_drafter(setup / "out" / name, target)
    res = speculative_generate(target, drafter, [[1, 5, 6]], 6, 1 if name == "mtp1" else 3)
    assert len(res.tokens[0]) == 6


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("name,cli,extra", [
    ("dspark", block_cli, ["--rank", "8", "--gammas", "3", "--anchors", "4", "--feature-layers", "0", "2"]),
    ("eagle", chain_cli, ["--steps-unroll", "2"]),
])
def test_init_fine_tunes_from_saved_weights(setup, name, cli, extra, capsys):
    """``--init DIR`` starts from a saved drafter: at learning rate 0 the saved weights come back unchanged, at the
    default rate they move from there; a different architecture or a missing directory is a clear error."""
    def run(tag, *more, arch=extra):
        cli.main(run_argv(setup, name, setup / "init_runs" / tag, setup / "init_out" / tag, *arch, *more))

    run(f"{name}-base", "--steps", "2")
    base = setup / "init_out" / f"{name}-base"
    run(f"{name}-lr0", "--steps", "1", "--lr", "0", "--init", str(base))
    start, same = _weights(base), _weights(setup / "init_out" / f"{name}-lr0")
    assert set(start) == set(same) and all(torch.equal(start[k], same[k]) for k in start)
    run(f"{name}-ft", "--steps", "2", "--init", str(base))
    moved = _weights(setup / "init_out" / f"{name}-ft")
    assert any(not torch.equal(start[k], moved[k]) for k in start)
    with pytest.raises(SystemExit) as exc:  # a usage error naming the option and the file
        run(f"{name}-missing", "--steps", "1", "--init", str(setup / "nowhere"))
    assert exc.value.code == 2 and "--init: no drafter weights at" in capsys.readouterr().err
    if cli is block_cli:
        with pytest.raises(ValueError, match="--init.*shape"):
            run(f"{name}-rank4", "--steps", "1", "--init", str(base), arch=[*extra, "--rank", "4"])
        # --anchor-feature adds a zero-initialised projection: at learning rate 0 the saved weights come back with it
        # at zero, and the drafter proposes exactly what the saved one does
        run(f"{name}-af0", "--steps", "1", "--lr", "0", "--init", str(base), arch=[*extra, "--anchor-feature"])
        grown = _weights(setup / "init_out" / f"{name}-af0")
        assert set(grown) == set(start) | {"anchor_proj.weight"} and not grown["anchor_proj.weight"].any()
        assert all(torch.equal(start[k], grown[k]) for k in start)
        target = load_model(setup / "target")
        runs = [speculative_generate(target, load_drafter(d, target), [[1, 5, 6], [1, 9]], 8, 3, temperature=1.0,
                                     seeds=[1, 2], record_traces=True)
                for d in (base, setup / "init_out" / f"{name}-af0")]
        assert runs[0].tokens == runs[1].tokens
        torch.testing.assert_close(runs[1].extra["confidence_logits"], runs[0].extra["confidence_logits"])
        with pytest.raises(ValueError, match="--init.*unexpected.*anchor_proj"):  # the other way is not allowed
            run(f"{name}-af-back", "--steps", "1", "--init", str(setup / "init_out" / f"{name}-af0"))


@pytest.mark.parametrize("name,cli,extra", [
    ("dspark", block_cli, ["--rank", "8", "--gammas", "3", "--anchors", "4", "--feature-layers", "0", "2"]),
    ("mtp1", chain_cli, []),
])
def test_draft_vocab_training_saves_its_ranking_and_drafts_over_it(setup, name, cli, extra):
    """``--draft-vocab K --token-ranking DIR`` trains over the ranking's first K tokens and ships that ranking with the
    drafter, which then drafts over the same K tokens; without ``--token-ranking`` it is a usage error."""
    from dspark_kernels.drafters.draft_vocab import load_token_ranking, save_token_ranking

    ranked = setup / "ranking_src"
    ranked.mkdir(exist_ok=True)
    ranking = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    save_token_ranking(ranking, ranked)
    out = setup / "out" / f"{name}-k16"
    cli.main(run_argv(setup, name, setup / "runs" / f"{name}-k16", out, *extra, "--steps", "2", "--draft-vocab", "16",
                      "--token-ranking", str(ranked)))
    assert torch.equal(load_token_ranking(out, 64), ranking)
    log = [json.loads(line) for line in (setup / "runs" / f"{name}-k16" / "log.jsonl").read_text().splitlines()]
    assert all(0 < r["l1"] <= 2 for r in log)
    target = load_model(setup / "target")
    drafter = load_drafter(out, target, draft_vocab=16)
    res = speculative_generate(target, drafter, [[1, 5, 6]], 6, 1 if name == "mtp1" else 3, temperature=1.0,
                               seeds=[0])
    assert len(res.tokens[0]) == 6
    with pytest.raises(SystemExit, match="--draft-vocab needs --token-ranking"):
        cli.main(run_argv(setup, name, setup / "runs" / "k16-bad", setup / "out" / "k16-bad", "--steps", "1",
                          "--draft-vocab", "16"))


@pytest.mark.parametrize("cli,argv,message", [
    (block_cli, ["--steps", "0"], "--steps: must be an int >= 1"),
    (block_cli, ["--batch-size", "0"], "--batch-size: must be an int >= 1"),
    (block_cli, ["--rank", "-4"], "--rank: must be an int >= 0"),
    (block_cli, ["--gammas", "3", "0"], "--gammas: must be an int >= 1"),
    (block_cli, ["--anchors", "0"], "--anchors: must be an int >= 1"),
    (block_cli, ["--ckpt-every", "0"], "--ckpt-every: must be an int >= 1"),
    (block_cli, ["--lr", "-1"], "--lr: must be a finite number >= 0"),
    (chain_cli, ["--name", "foo"], "--name: invalid choice"),
    (chain_cli, ["--ce-weight", "-1"], "--ce-weight: must be a finite number >= 0"),
    (chain_cli, ["--positions", "-5"], "--positions: must be an int >= 0"),
])
def test_bad_options_are_usage_errors(setup, cli, argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--target", str(setup / "target"), "--rollouts", str(setup / "rollouts"), "--out",
                  str(setup / "bad_out"), *argv])
    assert message in capsys.readouterr().err


def test_run_time_checks_of_the_trainers(setup):
    common = ["--target", str(setup / "target"), "--rollouts", str(setup / "rollouts"), "--steps", "1"]
    with pytest.raises(SystemExit, match="--batch-size 7 exceeds the 6 training rollouts"):
        block_cli.main([*common, "--name", "dspark", "--out", str(setup / "bs_out"), "--work-dir",
                        str(setup / "bs_run"), "--batch-size", "7"])
    more = setup / "more_rollouts"  # a second directory's rollouts join the pool: the same batch fits
    save_rollouts(Rollouts([[1, 9]] * 2, [[10, 11, 12]] * 2, [0.0] * 2, [0] * 2), more, "train")
    pooled = ["--target", str(setup / "target"), "--rollouts", str(setup / "rollouts"), str(more), "--steps", "1",
              "--name", "dspark", "--out", str(setup / "bs_out"), "--work-dir", str(setup / "bs_run")]
    with pytest.raises(SystemExit, match=f"--batch-size 9 exceeds the 8 training rollouts under .*rollouts, {more}"):
        block_cli.main([*pooled, "--batch-size", "9"])
    block_cli.main([*pooled, "--batch-size", "7", "--gammas", "3", "--anchors", "4", "--feature-layers", "0", "2"])
    assert json.loads((setup / "bs_out" / "train_summary.json").read_text())["args"]["rollouts"] == [
        str(setup / "rollouts"), str(more)]
    with pytest.raises(SystemExit, match="--ce-weight and --tv-weight are both 0"):
        chain_cli.main([*common, "--out", str(setup / "w_out"), "--work-dir", str(setup / "w_run"), "--ce-weight",
                        "0", "--tv-weight", "0", "--batch-size", "2"])
    arch = ["--gammas", "3", "--anchors", "4", "--feature-layers", "0", "2", "--batch-size", "2"]
    run = ["--name", "dspark", "--out", str(setup / "r_out"), "--work-dir", str(setup / "r_run"), "--ckpt-every", "1"]
    block_cli.main([*common, *run, *arch, "--rank", "8"])
    with pytest.raises(SystemExit, match="--resume: .* was saved for another architecture"):
        block_cli.main([*common[:-1], "2", *run, *arch, "--rank", "4", "--resume"])


def test_missing_inputs_are_usage_errors(setup, tmp_path, capsys, monkeypatch):
    """A missing target, rollouts directory or drafter ends the tools with a usage error naming it (status 2)."""
    from dspark_kernels.bench.__main__ import main as bench_main
    from dspark_kernels.train import calibration

    missing = str(tmp_path / "nope")
    runs = [
        (block_cli.main, ["--target", str(setup / "target"), "--rollouts", missing, "--out", missing],
         "no train rollouts under"),
        (chain_cli.main, ["--target", missing, "--rollouts", str(setup / "rollouts"), "--out", missing],
         "is not a registry name"),
        (calibration.main, ["--model", str(setup / "target"), "--drafter", missing], "drafter checkpoint file missing"),
    ]
    for main, argv, message in runs:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["bench", "acceptance", "--drafter-dir", missing, "--num-prompts", "1"])
    with pytest.raises(SystemExit) as exc:
        bench_main()
    assert exc.value.code == 2 and "no such drafter under" in capsys.readouterr().err


@pytest.mark.parametrize("name,cli,extra", [
    ("dspark", block_cli, ["--rank", "8", "--gammas", "3", "5", "--anchors", "4", "--feature-layers", "0", "2"]),
    ("eagle", chain_cli, ["--steps-unroll", "2"]),
])
def test_a_run_interrupted_and_resumed_ends_bit_identical(setup, name, cli, extra, monkeypatch):
    """Checkpoints hold the model, the optimiser, the step and the batch sampler's state: a run killed after step 3 and
    resumed ends with exactly the weights of the same run done in one go."""
    from dspark_kernels.train import loop

    def run(tag, *more):
        cli.main(run_argv(setup, name, setup / "kill_runs" / tag, setup / "kill_out" / tag, "--ckpt-every", "1",
                          "--steps", "5", *extra, *more))

    def interrupted_after(n):
        def run_training(drafter, args, rng, loss_fn, **options):
            calls = []

            def dying_loss():
                calls.append(1)
                if len(calls) > n:
                    raise KeyboardInterrupt
                return loss_fn()
            return loop.run_training(drafter, args, rng, dying_loss, **options)
        return run_training

    run("straight")
    monkeypatch.setattr(cli, "run_training", interrupted_after(3))
    with pytest.raises(KeyboardInterrupt):
        run("killed")
    monkeypatch.undo()
    run("killed", "--resume")
    one_go, resumed = _weights(setup / "kill_out" / "straight"), _weights(setup / "kill_out" / "killed")
    assert set(one_go) == set(resumed) and all(torch.equal(one_go[k], resumed[k]) for k in one_go)


def test_calibration_refuses_a_drafter_without_a_confidence_head(setup, tmp_path):
    """DFlash (rank 0, CE only) has no confidence head: calibration says so instead of failing on missing traces."""
    rng = random.Random(1)
    held = Rollouts([[1, rng.randrange(4, 64)] for _ in range(4)], [[rng.randrange(4, 64) for _ in range(8)]] * 4,
                    [1.0] * 4, [0] * 4)
    save_rollouts(held, tmp_path / "rollouts", "heldout")
    block_cli.main(run_argv(setup, "dflash", tmp_path / "run", tmp_path / "dflash", "--loss", "dflash", "--rank", "0",
                            "--gammas", "3", "--anchors", "4", "--feature-layers", "1", "--steps", "1"))
    from dspark_kernels.train import calibration

    with pytest.raises(SystemExit, match="this drafter has no confidence head"):
        calibration.main(["--model", str(setup / "target"), "--drafter", str(tmp_path / "dflash"), "--rollouts",
                          str(tmp_path / "rollouts"), "--gamma", "3", "--num-prompts", "4", "--max-new-tokens", "4",
                          "--device", "cpu"])


def test_assistant_trainer_cuts_the_target_trains_and_assists_transformers(setup, tmp_path):
    """The assistant starts as the target's first and last layers with its frozen embedding and LM head, trains
    (the loss falls, the frozen weights stay), saves a directory transformers loads, and assisted generation with it
    reproduces the target's greedy output."""
    from transformers import AutoModelForCausalLM

    from dspark_kernels.train import assistant as assistant_cli

    target = Qwen3ForCausalLM.from_pretrained(setup / "target")
    made = assistant_cli.Assistant(setup / "target", 2)
    assert made.source_layers == [0, 3]
    for mine, theirs in ((0, 0), (1, 3)):
        torch.testing.assert_close(made.model.model.layers[mine].mlp.up_proj.weight,
                                   target.model.layers[theirs].mlp.up_proj.weight)
    out = tmp_path / "assistant"
    assistant_cli.main(run_argv(setup, "assistant", tmp_path / "work", out, "--steps", "30", "--positions", "8",
                                "--lr", "3e-3"))
    losses = [json.loads(line)["loss"] for line in (tmp_path / "work" / "log.jsonl").read_text().splitlines()]
    assert sum(losses[-5:]) < sum(losses[:5])
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert trained.config.num_hidden_layers == 2
    torch.testing.assert_close(trained.model.embed_tokens.weight,
                               target.model.embed_tokens.weight.to(torch.bfloat16).float())
    ids = torch.tensor([[1, 7, 9, 11]])
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=trained)
    assert torch.equal(plain, assisted)
    with pytest.raises(SystemExit):
        assistant_cli.main(run_argv(setup, "assistant", tmp_path / "w2", tmp_path / "o2", "--layers", "9"))
