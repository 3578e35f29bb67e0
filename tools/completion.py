#!/usr/bin/env python3
"""Bash completion for ``dsr1d`` and ``dsr1ctl``, generated from their argparse parsers.

``tools/completion.py dsr1d`` (or ``dsr1ctl``) prints the script shipped as
etc/bash-completion/<command>; tests/test_completion_generated.py fails when they differ.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

# How a value is completed: one bash statement each ("" completes nothing).
FILES = 'compopt -o filenames 2>/dev/null; mapfile -t COMPREPLY < <(compgen -f -- "$cur")'
PROFILES = 'COMPREPLY=($(compgen -W "$(@FN@_profiles "${given[@]}")" -- "$cur"))'
PATH_DESTS = {"root", "journal", "profiles_dir", "config", "csv", "fake_root", "model", "file",
              "out", "dir", "src", "cache_dir", "baseline"}
PROFILE_DESTS = {"profile", "name"}


@dataclass
class Node:
    """One command level: its options (None: a flag; else how its value completes), its
    sub-commands, its positionals in order and how those after them (nargs * or +) complete."""

    options: dict[str, str | None] = field(default_factory=dict)
    commands: dict[str, Node] = field(default_factory=dict)
    positionals: list[str] = field(default_factory=list)
    rest: str | None = None


def _words(words: Sequence[object]) -> str:
    return 'COMPREPLY=($(compgen -W "' + " ".join(map(str, words)) + '" -- "$cur"))'


def _value(action: argparse.Action) -> str:
    if action.choices:
        return _words(list(action.choices))
    if action.type is Path or action.dest in PATH_DESTS:
        return FILES
    return PROFILES if not action.option_strings and action.dest in PROFILE_DESTS else ""


def tree(parser: argparse.ArgumentParser,
         grafts: Mapping[str, argparse.ArgumentParser] | None = None, path: str = "") -> Node:
    """The parser's command tree. ``grafts`` maps a command path ("model", "model synth") whose
    REMAINDER positional is handed to another parser to that parser, merged in its place."""
    node, grafts = Node(), grafts or {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                node.commands[name] = tree(sub, grafts, f"{path} {name}".strip())
        elif action.option_strings:
            if action.help is not argparse.SUPPRESS:
                node.options.update(dict.fromkeys(
                    action.option_strings, None if action.nargs == 0 else _value(action)))
        elif action.nargs == argparse.REMAINDER and path in grafts:
            graft = tree(grafts[path], {k: v for k, v in grafts.items() if k != path}, path)
            node.options.update(graft.options)
            node.commands.update(graft.commands)
            node.positionals += graft.positionals
            node.rest = graft.rest
        elif action.nargs in ("*", "+", argparse.REMAINDER):
            node.rest = _value(action)
        else:
            node.positionals += [_value(action)] * (action.nargs if isinstance(action.nargs, int)
                                                    else 1)
    return node


def _walk(node: Node, path: str = "") -> Iterator[tuple[str, Node]]:
    yield path, node
    for name, sub in node.commands.items():
        yield from _walk(sub, f"{path} {name}".strip())


def _case(groups: Mapping[str, list[str]], indent: str) -> list[str]:
    """Case arms: each statement after its patterns (quoted; a * at either end stays a glob)."""
    arms = []
    for statement, patterns in groups.items():
        pats = "|".join(("*" if p.startswith("*") else "") + f'"{p.strip("*")}"'
                        + ("*" if p.endswith("*") else "") for p in patterns)
        arms.append(f"{indent}{pats}) {statement + ' ' if statement else ''};;")
    return arms


def _group(pairs: Iterator[tuple[str, str]]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for statement, pattern in pairs:
        if pattern not in groups.setdefault(statement, []):
            groups[statement].append(pattern)
    return groups


def render(prog: str, root: Node, list_args: Sequence[str], header: str) -> str:
    """The bash completion script for ``prog``: the command path is found skipping options and
    their values; profile names come from ``prog GLOBAL-OPTIONS... list_args`` (JSON)."""
    fn = "_" + re.sub(r"\W", "_", prog)
    nodes = list(_walk(root))
    kinds: dict[str, set[str]] = {}  # an option's value completions over every command
    for _, n in nodes:
        for option, how in n.options.items():
            if how is not None:
                kinds.setdefault(option, set()).add(how)
    values = _group((how, f"*:{o}" if len(kinds[o]) == 1 else f"{p}:{o}")
                    for p, n in nodes for o, how in n.options.items() if how)
    exact = _group((how, f"{p}:{i}") for p, n in nodes for i, how in enumerate(n.positionals))
    tail = _group((_words(n.commands) if n.commands else n.rest or "", f"{p}:*")
                  for p, n in nodes if n.commands or n.rest is not None)
    table = _group((f'opts="{" ".join(n.options)}" vals="'
                    + " ".join(o for o, how in n.options.items() if how is not None) + '"', p)
                   for p, n in nodes)
    moves = [f"{p}:{c}" for p, n in nodes for c in n.commands]
    globals_ = "|".join(o for o, how in root.options.items() if how is not None)
    lines = [
        f"# {header}",
        f"{fn}_profiles() {{",
        f"    {prog} \"$@\" {' '.join(list_args)} 2>/dev/null"
        " | sed -n 's/^  \"name\": \"\\(.*\\)\",\\{0,1\\}$/\\1/p'",
        "}", "",
        f"{fn}_options() {{  # sets opts (all) and vals (those taking a value) of command path $1",
        "    case $1 in",
        *_case(table, " " * 8),
        "    esac",
        "}", "",
        f"{fn}() {{",
        '    local cur=${COMP_WORDS[COMP_CWORD]} node="" want="" opts vals npos=0 ddash=0 w i',
        "    local -a given=()",
        "    COMPREPLY=()",
        f'    {fn}_options ""',
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        "        w=${COMP_WORDS[i]}",
        "        if [[ -n $want ]]; then",
        "            [[ $w == = ]] && continue",
        *([f'            case $want in {globals_}) given+=("$want" "$w") ;; esac'] if globals_
          else []),
        '            want=""',
        "        elif [[ $w == -- ]] && ((!ddash)); then",
        "            ddash=1",
        "        elif [[ $w == -* ]] && ((!ddash)); then",
        '            [[ " $vals " == *" $w "* ]] && want=$w',
        "        else",
        '            case "$node:$w" in',
        *_case({f'node=${{node:+$node }}$w; npos=0; {fn}_options "$node"': moves}, " " * 16),
        "                *) npos=$((npos + 1)) ;;",
        "            esac",
        "        fi",
        "    done",
        '    [[ $cur == = ]] && cur=""',
        "    if [[ -n $want ]]; then",
        '        case "$node:$want" in',
        *_case(values, " " * 12),
        "        esac",
        "    elif [[ $cur == -* ]] && ((!ddash)); then",
        '        COMPREPLY=($(compgen -W "$opts" -- "$cur"))',
        "    else",
        '        case "$node:$npos" in',
        *_case(exact, " " * 12),
        *_case(tail, " " * 12),
        '            *) COMPREPLY=($(compgen -W "$opts" -- "$cur")) ;;',
        "        esac",
        "    fi",
        "}",
        f"complete -F {fn} {prog}",
    ]
    return "\n".join(lines).replace("@FN@", fn) + "\n"


def script(prog: str) -> str:
    """The completion script for ``dsr1d`` or ``dsr1ctl``, as shipped in etc/bash-completion."""
    header = (f"Generated by `tools/completion.py {prog} > "
              f"etc/bash-completion/{prog}` from its argparse parsers: do not edit.")
    if prog == "dsr1ctl":
        from dsr1d.client.cli import parser as ctl_parser

        return render(prog, tree(ctl_parser()), ["--json", "list"], header)
    if prog != "dsr1d":
        raise ValueError(f"no completion for {prog!r}: dsr1d or dsr1ctl")
    from dsr1d.edges.admin import parser as admin_parser
    from dsr1d.engine import check, gguf_convert, synth
    from dsr1d.sim import sim

    model = argparse.ArgumentParser(prog="dsr1d model", add_help=False)
    tools = model.add_subparsers()
    for name, module in (("synth", synth), ("convert", gguf_convert), ("check", check)):
        tools.add_parser(name, parents=[module._parser()], add_help=False)
    grafts = {"model": model, "simulate": sim._parser()}
    return render(prog, tree(admin_parser(), grafts), ["list", "--json"], header)


def main(argv: list[str] | None = None) -> int:
    """``tools/completion.py dsr1d|dsr1ctl``: print that command's script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv not in (["dsr1d"], ["dsr1ctl"]):
        print("usage: tools/completion.py dsr1d|dsr1ctl", file=sys.stderr)
        return 2
    sys.stdout.write(script(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
