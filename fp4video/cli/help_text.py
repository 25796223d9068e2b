"""The command line's help in plain text: descriptions and help strings come from docstrings,
written in reStructuredText (````x````, ``:func:`x```), which ``--help`` would print as such."""

from __future__ import annotations

import argparse
import re

#: ``:role:`~.target``` cross-references and ````literal```` spans
_ROLE = re.compile(r":(?:func|mod|class|data|attr|meth|obj|const|exc):`~?\.?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str | None) -> str | None:
    """``text`` with reStructuredText's literals and cross-references as `single backticks`."""
    if not text:
        return text
    return _LITERAL.sub(r"`\1`", _ROLE.sub(r"`\1`", text))


def plain_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Rewrite ``parser``'s description, epilog and every argument's help with :func:`plain`, and
    those of its subcommands, in place; returns ``parser``."""
    parser.description, parser.epilog = plain(parser.description), plain(parser.epilog)
    for action in parser._actions:
        action.help = plain(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:  # the subcommands' one-line help in the listing
                choice.help = plain(choice.help)
            for sub in set(action.choices.values()):
                plain_help(sub)
    return parser
