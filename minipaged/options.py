"""Engine options on the command line: one flag per ``EngineConfig`` field, and the one way to build an engine.

Every command that runs an engine (``minipaged generate``, ``minipaged watch``, a lesson's live run) takes the
same engine flags, so they are derived here from ``EngineConfig``'s fields rather than written out per
command: the name gives the flag (``max_num_seqs`` -> ``--max-num-seqs``), the type gives what it parses
(``Optional[int]`` -> int, a ``Literal`` -> its choices), and the field's metadata gives the help text and
the default the help shows. Adding a field with ``metadata={"help": ...}`` to ``EngineConfig`` is all it
takes for a new flag to appear on every command; ``metadata={"flag": False}`` keeps a field off the command
line. A bool that defaults to True becomes a switch that turns it off: ``enable_prefix_caching`` ->
``--no-prefix-caching``; an ``Optional[bool]`` (None: the code's own default) gets both ``--x`` and ``--no-x``.

Engine flags parse to None unless typed, so code can tell "left unset" from "set to the default": a
workload's or a lesson's own options give way only to flags the user typed.

This module stays free of torch and transformers (the TUI's replay and thin clients import it); ``Engine``
is imported only when ``build_engine`` runs.
"""
from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import MISSING, Field, dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union, get_args, get_origin, get_type_hints

from .config import ConfigError, EngineConfig

if TYPE_CHECKING:
    from .engine import Engine

Progress = Callable[[str], None]

MODEL_HELP = ("'smollm2' (embedded default), 'tinyllama', a local HF folder, a .gguf file or a hub id of a Llama, "
              "Mistral, Qwen2 or Qwen3 model")


@dataclass(frozen=True)
class EngineFlag:
    """One ``EngineConfig`` field as a command-line flag."""

    name: str                                   # the field: max_num_seqs
    flag: str                                   # what the user types: --max-num-seqs, --no-prefix-caching
    help: str
    shown_default: str                          # what "(default: ...)" says in the help
    value_type: Optional[type] = None           # int, float or str; None for a switch
    choices: Optional[tuple[str, ...]] = None   # from a Literal type
    switch_to: Optional[bool] = None            # a switch (no value) sets the field to this
    aliases: tuple[str, ...] = ()               # other spellings of the flag (``--threads``)
    negatable: bool = False                     # a switch that also has its --no-... form (vLLM's BooleanOptional)

    def words(self, value: Any) -> list[str]:
        """What to type to set this option to ``value``: ["--policy", "static"], ["--no-prefix-caching"],
        or nothing when a switch's value is the default already."""
        if self.negatable:
            return [self.flag if value else "--no-" + self.flag.removeprefix("--")]
        if self.switch_to is not None:
            return [self.flag] if value == self.switch_to else []
        return [self.flag, json.dumps(value) if isinstance(value, dict) else str(value)]


def _value_type(hint: Any) -> tuple[type, Optional[tuple[str, ...]]]:
    """What a field's type parses as on the command line: Optional[int] -> int, Literal["a", "b"] -> str
    with choices ("a", "b")."""
    if get_origin(hint) is Union:                                  # Optional[X] is Union[X, None]
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        return type(choices[0]), choices
    return hint, None


def _flag_of(f: Field, hints: dict[str, Any]) -> EngineFlag:
    if "help" not in f.metadata:
        raise TypeError(f"EngineConfig.{f.name} has no flag decided: give it metadata={{'help': ...}} to make it "
                        f"a command-line flag, or metadata={{'flag': False}} to keep it off the command line.")
    default = f.default if f.default is not MISSING else None
    shown = str(f.metadata.get("shown_default", default))
    if isinstance(default, bool):          # a switch: it flips the default
        flag = "--no-" + f.name.removeprefix("enable_") if default else "--" + f.name
        return EngineFlag(f.name, flag.replace("_", "-"), f.metadata["help"], shown, switch_to=not default,
                          negatable=f.metadata.get("negatable", False))
    value_type, choices = _value_type(hints[f.name])
    if value_type is bool:                 # Optional[bool], None by default: --name and --no-name both say
        return EngineFlag(f.name, "--" + f.name.replace("_", "-"), f.metadata["help"], shown, switch_to=True,
                          negatable=True)
    value_type = f.metadata.get("cli_type", value_type)    # a dict field is typed as JSON text
    return EngineFlag(f.name, "--" + f.name.replace("_", "-"), f.metadata["help"], shown, value_type, choices,
                      aliases=tuple(f.metadata.get("aliases", ())))


def engine_flags() -> list[EngineFlag]:
    """Every EngineConfig field that is a flag, in the order of the fields."""
    hints = get_type_hints(EngineConfig)
    return [_flag_of(f, hints) for f in fields(EngineConfig) if f.metadata.get("flag", True)]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's, but a line never breaks inside a hyphenated word: ``lowest-priority`` stays one word, and
    "(default: ...)" is added only where it says something: not after a help that gives its own default, and
    not "(default: None)" for a flag that is simply off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is None:
            return text
        return super()._get_help_string(action)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def add_engine_arguments(parser: argparse.ArgumentParser, *, model_default: str = "smollm2") -> None:
    """``--model`` and every engine option as a flag, in an "engine" group. The help shows the default the
    engine applies (the flag itself parses to None unless given)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=model_default, help=MODEL_HELP)
    for f in engine_flags():
        # argparse %-formats help; "%(default).0s" prints nothing and stops ArgumentDefaultsHelpFormatter
        # from adding "(default: None)" of its own.
        help_text = f"{f.help} (default: {f.shown_default})".replace("%", "%%") + "%(default).0s"
        if f.negatable:                    # --async-output-processing and --no-async-output-processing
            group.add_argument(f.flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif f.switch_to is not None:
            group.add_argument(f.flag, dest=f.name, action=f"store_{str(f.switch_to).lower()}", default=None,
                               help=help_text)
        else:
            group.add_argument(f.flag, *f.aliases, dest=f.name, type=f.value_type, choices=f.choices, default=None,
                               help=help_text)
    _add_speculative_arguments(parser)


# The seed guide's spelling of speculative decoding (vLLM's older flags): each fills one key of
# speculative_config, on top of whatever --speculative-config JSON gave.
SPECULATIVE_FLAGS = (
    ("--speculative-method", "method", str, "ngram, draft_model, or int8_self_draft (the target's own weights "
                                            "in int8 draft for it)"),
    ("--num-speculative-tokens", "num_speculative_tokens", int, "tokens drafted per step (k)"),
    ("--speculative-model", "model", str, "the draft model (a checkpoint with the same vocabulary, or "
                                         "'self' for the target's first --num-draft-layers layers)"),
    ("--num-draft-layers", "num_draft_layers", int, "layers of a self-draft"),
    ("--prompt-lookup-min", "prompt_lookup_min", int, "ngram: shortest n-gram to match (default: 5)"),
    ("--prompt-lookup-max", "prompt_lookup_max", int, "ngram: longest n-gram to match (default: 5)"),
    ("--speculative-auto-k", "auto_k", None, "choose each request's k every step (at most "
                                            "--num-speculative-tokens; 0 where drafts lose)"),
)


def _add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (or --speculative-config JSON)")
    for flag, key, value_type, help_text in SPECULATIVE_FLAGS:
        if value_type is None:                             # a switch: present means true
            group.add_argument(flag, dest="spec_" + key, action="store_const", const=True, default=None,
                               help=help_text)
        else:
            group.add_argument(flag, dest="spec_" + key, type=value_type, default=None, help=help_text)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine(**options) the user gave as flags; everything else keeps the engine's default."""
    options = {f.name: getattr(args, f.name) for f in engine_flags() if getattr(args, f.name, None) is not None}
    typed = {key: getattr(args, "spec_" + key) for _flag, key, _t, _h in SPECULATIVE_FLAGS
             if getattr(args, "spec_" + key, None) is not None}
    given = options.get("speculative_config")
    if isinstance(given, str):
        try:
            given = options["speculative_config"] = json.loads(given)
        except json.JSONDecodeError:
            return options                                 # the engine's check says what is wrong with it
    if typed and (given is None or isinstance(given, dict)):
        if "method" not in typed and "model" in typed and not given:
            typed["method"] = "draft_model"                # --speculative-model M alone, as in the guide
        options["speculative_config"] = {**(given or {}), **typed}
        if "num_speculative_tokens" not in options["speculative_config"]:
            # the flags' spelling, not the config key the engine's own check would name
            method = options["speculative_config"].get("method")
            what = f"--speculative-method {method}" if method else "speculative decoding"
            raise ConfigError(f"{what} needs --num-speculative-tokens K: how many tokens to draft per step, "
                              f"e.g. --num-speculative-tokens 3.")
    return options


def as_flag(name: str) -> str:
    """An option's command-line flag: max_num_seqs -> --max-num-seqs, enable_prefix_caching ->
    --no-prefix-caching. Names that are not engine options (workload flags) get dashes the same way."""
    for f in engine_flags():
        if f.name == name:
            return f.flag
    return "--" + name.replace("_", "-")


def as_command_line(options: dict[str, Any]) -> list[str]:
    """The flags that set these engine options: {"policy": "static"} -> ["--policy", "static"]."""
    by_name = {f.name: f for f in engine_flags()}
    return [word for name, value in options.items() for word in by_name[name].words(value)]


def build_engine(model: str, options: dict[str, Any], progress: Optional[Progress] = None) -> "Engine":
    """The engine every command runs: ``model`` with ``options`` (checked by EngineConfig, so a bad value
    fails here with a message naming the fix). ``progress`` hears what loading is doing."""
    from .engine import Engine            # torch and transformers: only once an engine is really wanted
    return Engine(model, load_progress=progress, **options)


__all__ = ["HelpFormatter", "EngineFlag", "engine_flags", "add_engine_arguments", "engine_options", "as_flag", "as_command_line",
           "build_engine"]
