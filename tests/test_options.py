"""Engine flags come from EngineConfig's fields, the same on every command, and the TUI and lessons reach
them through minipaged.options, never through the CLI module."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from minipaged.cli import main, make_parser
from minipaged.config import ConfigError, EngineConfig
from minipaged.options import EngineFlag, as_command_line, as_flag, engine_flags, engine_options

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["generate", "watch"]            # every command that runs an engine


def sample_value(flag: EngineFlag) -> object:
    """A value to type for ``flag`` (one the parser accepts; the engine's validation is not the point here)."""
    if flag.switch_to is not None:
        return flag.switch_to
    if flag.choices:
        return flag.choices[-1]
    return {int: 8, float: 0.5, str: "cpu"}[flag.value_type]


def test_every_config_field_is_a_flag_or_says_it_is_not():
    flagged = [f.name for f in fields(EngineConfig) if f.metadata.get("flag", True)]
    for f in fields(EngineConfig):
        assert f.metadata.get("flag") is False or f.metadata.get("help"), \
            f"EngineConfig.{f.name}: give it metadata help=... (a flag) or flag=False"
    assert [flag.name for flag in engine_flags()] == flagged
    assert "model" not in flagged                     # each command adds --model with its own default


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flagged_field_is_in_the_help_of_every_command(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())          # the help wraps lines: compare word runs
    for flag in engine_flags():
        assert f"{flag.flag} " in text or text.endswith(flag.flag), f"{flag.flag} missing from {command} --help"
        assert f"{flag.help} (default: {flag.shown_default})" in text, f"{flag.flag}'s help in {command} --help"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", engine_flags(), ids=lambda flag: flag.flag)
def test_each_engine_flag_parses_to_its_option_alone(command, flag):
    value = sample_value(flag)
    args = make_parser().parse_args([command, *flag.words(value)])
    assert engine_options(args) == {flag.name: value}


@pytest.mark.parametrize("command", COMMANDS)
def test_untyped_flags_stay_unset_and_typed_ones_keep_their_type(command):
    parse = make_parser().parse_args
    assert engine_options(parse([command])) == {}               # nothing typed: the engine's defaults apply
    assert engine_options(parse([command, "--max-num-seqs", "8"])) == {"max_num_seqs": 8}
    # A flag typed with the engine's default value is still "typed", not "left unset".
    assert engine_options(parse([command, "--max-num-seqs", "256"])) == {"max_num_seqs": 256}
    assert engine_options(parse([command, "--no-prefix-caching", "--kv-cache-memory", "0.25"])) == \
        {"enable_prefix_caching": False, "kv_cache_memory": 0.25}
    with pytest.raises(SystemExit):
        parse([command, "--policy", "fastest"])               # a Literal type gives the flag its choices


def test_option_names_and_values_turn_back_into_flags():
    assert as_flag("max_num_seqs") == "--max-num-seqs"
    assert as_flag("enable_chunked_prefill") == "--no-chunked-prefill"      # what the user types, not the name
    assert as_flag("num_requests") == "--num-requests"                      # a workload flag: dashes the same way
    options = {"policy": "static", "enable_prefix_caching": False, "num_blocks": 64}
    words = as_command_line(options)
    assert words == ["--policy", "static", "--no-prefix-caching", "--num-blocks", "64"]
    assert engine_options(make_parser().parse_args(["generate", *words])) == options
    assert as_command_line({"enable_prefix_caching": True}) == []          # the default needs no flag


def imported_modules(source: str, package: str) -> list[str]:
    """Every module that ``source`` (a module of ``package``) imports, relative imports resolved:
    ``from ..cli import main`` in minipaged.tui is minipaged.cli, and so is ``from .. import cli``."""
    parts = package.split(".")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return found


@pytest.mark.parametrize("folder", ["tui", "lessons"])
def test_the_tui_and_the_lessons_do_not_import_the_cli(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    offenders = []
    for path in files:
        package = ".".join(["minipaged", *path.relative_to(ROOT).parent.parts])   # tui/ is minipaged.tui
        if "minipaged.cli" in imported_modules(path.read_text(encoding="utf-8"), package):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"these import minipaged.cli (import minipaged.options instead): {', '.join(offenders)}"


@pytest.mark.parametrize("line", ["import minipaged.cli", "from minipaged.cli import main",
                                  "from minipaged import cli", "from ...cli import main", "from ... import cli",
                                  "def f():\n    from minipaged.cli import as_flag"])
def test_the_import_check_sees_every_spelling(line):
    assert "minipaged.cli" in imported_modules(line, "minipaged.tui.widgets")


def test_the_import_check_lets_other_imports_pass():
    source = "from minipaged.options import as_flag\nfrom . import cli\nimport minipaged.client"
    assert "minipaged.cli" not in imported_modules(source, "minipaged.tui.widgets")


def test_options_and_the_tui_entry_stay_free_of_torch():
    """A replay and thin clients import these without paying for torch or transformers."""
    code = ("import sys, minipaged.options, minipaged.cli, minipaged.tui; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def every_parser(parser, name="minipaged"):
    yield name, parser
    if parser._subparsers:
        for word, sub in parser._subparsers._group_actions[0].choices.items():
            yield from every_parser(sub, f"{name} {word}")


def test_no_help_says_its_default_twice_or_says_default_none():
    doubled = []
    for name, parser in every_parser(make_parser()):
        for action in parser._actions:
            if not action.help or action.help == "==SUPPRESS==":
                continue
            text = parser._get_formatter()._expand_help(action)
            if text.count("(default") > 1 or "(default: None)" in text:
                doubled.append(f"{name} {'/'.join(action.option_strings) or action.dest}: ...{text[-60:]}")
    assert not doubled, "\n".join(doubled)


@pytest.mark.parametrize("flags", [["--speculative-method", "ngram"], ["--speculative-method", "draft_model",
                                                                         "--speculative-model", "self"]])
def test_speculation_without_a_count_names_the_flag_to_add(flags, capsys):
    assert main(["generate", *flags, "hello"]) == 2                  # before any model is loaded
    err = capsys.readouterr().err
    assert f"--speculative-method {flags[1]} needs --num-speculative-tokens" in err
    assert "speculative_config" not in err


# The engine's switches are options (issue 46, item 6); these MINIPAGED_ names are not switches of the engine: the
# cache folder, where plot writes its pictures, the parallel launcher's device, two test harnesses' inputs, and the
# model a generated lesson notebook runs on (CI's tiny one; minipaged/notebook/lessons.py).
NOT_ENGINE_SWITCHES = {"MINIPAGED_CACHE", "MINIPAGED_PICTURES", "MINIPAGED_DEVICE", "MINIPAGED_FOLD_CASES",
                       "MINIPAGED_SPEC_CASES"}


def test_no_engine_switch_is_an_environment_variable():
    """Every switch of the engine is an EngineConfig field (a flag of every command) or a server option: no
    MINIPAGED_ variable outside the allow-list is read by the code, set by the tests, or named by the docs."""
    folders = ["minipaged", "kernels", "tui", "lessons", "bench", "tests", "docs"]
    files = [path for folder in folders for path in (ROOT / folder).rglob("*")
             if path.suffix in (".py", ".md", ".in", ".mjs", ".js", ".toml") and ".venv" not in path.parts]
    files += [ROOT / "README.md", ROOT / "Makefile"]
    found = {}
    for path in files:
        for name in re.findall(r"\bMINIPAGED_[A-Z0-9_]+", path.read_text(encoding="utf-8", errors="replace")):
            if name not in NOT_ENGINE_SWITCHES and path != Path(__file__):
                found.setdefault(name, str(path.relative_to(ROOT)))
    assert not found, f"environment switches left (make each an option): {found}"


@pytest.mark.parametrize("command", [*COMMANDS, "serve"])
def test_the_former_environment_switches_are_flags_of_every_command(command):
    parse = make_parser().parse_args
    typed = [command, "--cpu-ops", "torch", "--no-compiled-decode", "--no-triton-fused-ops", "--grammar-timeout", "2"]
    assert engine_options(parse(typed)) == {"cpu_ops": "torch", "compiled_decode": False, "triton_fused_ops": False,
                                            "grammar_timeout": 2.0}
    assert engine_options(parse([command, "--triton-fused-ops"])) == {"triton_fused_ops": True}
    with pytest.raises(SystemExit):
        parse([command, "--cpu-ops", "fast"])


def test_server_limits_are_serve_flags_spelled_once(capsys):
    """Each ServerLimits field is a flag of its name with dashes whose help is the field's."""
    from minipaged.serve import server_settings
    from minipaged.serve.limits import ServerLimits
    args = make_parser().parse_args(["serve", "--max-n", "3", "--max-prompt-logprobs", "5"])
    settings = server_settings(args)
    assert settings.limits == ServerLimits(max_n=3, max_prompt_logprobs=5)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for limit in fields(ServerLimits):
        assert f"{ServerLimits.flag(limit.name)} " in text and limit.metadata["help"] in text, limit.name


def test_the_grammar_timeout_option_reaches_the_logits_stage(tiny_engine_factory):
    assert tiny_engine_factory(grammar_timeout=0.5).logits.compiler.timeout_s == 0.5
    with pytest.raises(ConfigError, match="grammar_timeout must be a positive number of seconds"):
        tiny_engine_factory(grammar_timeout=0)
