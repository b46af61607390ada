"""Every option of every command-line tool has help text (``--help`` lists what each option does, not bare names)."""

import argparse
import importlib

import pytest

MAINS = ["dspark_kernels.demo", "dspark_kernels.bench.__main__", "dspark_kernels.train.drafter",
         "dspark_kernels.train.chain_drafter", "dspark_kernels.train.rollouts", "dspark_kernels.train.prompts.__main__",
         "dspark_kernels.train.corpus", "dspark_kernels.train.tokenizer", "dspark_kernels.train.target",
         "dspark_kernels.train.calibration", "dspark_kernels.train.model_card", "dspark_kernels.train.token_ranking",
         "dspark_kernels.train.assistant", "dspark_kernels.engine.sps",
         "dspark_kernels.autotune.tune", "dspark_kernels.assets.__main__", "dspark_kernels.models.convert"]


class _Parsed(Exception):
    pass


def _parsers(module: str, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parser a tool's ``main`` builds (and its subcommands' parsers), captured at ``parse_args``."""
    seen: list[argparse.ArgumentParser] = []

    def capture(self, *a, **k):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr("sys.argv", ["tool"])
    mod = importlib.import_module(module)
    with pytest.raises(_Parsed):
        mod.main() if module.endswith("bench.__main__") else mod.main([])
    parsers = list(seen)
    for parser in seen:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    return parsers


@pytest.mark.parametrize("module", MAINS)
def test_every_option_has_help(module, monkeypatch):
    missing = [f"{parser.prog} {'/'.join(a.option_strings) or a.dest}" for parser in _parsers(module, monkeypatch)
               for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert not missing, f"options without help text: {missing}"


@pytest.mark.parametrize("module", MAINS)
def test_help_renders(module, monkeypatch):
    """``--help`` formats (a bare ``%`` in a help string breaks argparse's expansion)."""
    for parser in _parsers(module, monkeypatch):
        assert parser.format_help()
