"""`qdeploy --help` and `qdeploy COMMAND --help` (issue #20): every subcommand has a one-line summary, a description,
help text for each option and an example; `qdeploy doctor` prints its install hints whole."""
import argparse

import pytest

from qdeploy.cli import build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


SUBCOMMANDS = sorted(_subparsers())


def test_every_subcommand_is_listed_with_a_one_line_summary(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {c.dest: c.help for c in action._choices_actions}
    assert set(summaries) == set(SUBCOMMANDS) and len(SUBCOMMANDS) >= 11
    for name, summary in summaries.items():
        assert summary and "\n" not in summary, name
        assert name in out and summary.split()[0] in out
    assert "example:" in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help_has_description_options_and_example(name, capsys):
    sub = _subparsers()[name]
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert sub.description and len(sub.description.split()) >= 8, name
    # the description's own words, not argparse's generic text
    assert sub.description.split("\n")[0] in out
    options = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
    assert options, name
    for action in options:
        assert action.help, f"qdeploy {name}: {action.option_strings or action.dest} has no help text"
        assert action.help.split()[0] in out
        for flag in action.option_strings:
            assert flag in out
    assert "example:" in out and f"qdeploy {name}" in out.split("example:")[1]


def test_doctor_keeps_the_brackets_of_install_hints(capsys):
    """rich read '[tensorrt]' in "pip install 'qdeploy[tensorrt]'" as a style tag and dropped it."""
    assert main(["doctor"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    from qdeploy.facts.tensorrt import tensorrt_version

    if tensorrt_version() is None:
        assert "pip install 'qdeploy[tensorrt]'" in out
    assert "tensorrt:" in out and "quantizers" in out
