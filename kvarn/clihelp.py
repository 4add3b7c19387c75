"""What kvarn's command lines share: ``--help`` that shows each option's default.

Below both ``kvarn`` (:mod:`kvarn.cli`) and ``kvarn-tune`` (:mod:`kvarn.autotune.cli`), so that
neither imports the other.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless its text gives the default already, or
    there is none to give (no default, an off switch, an empty string)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if any(default is x for x in (None, False, argparse.SUPPRESS)) or default == "" or not action.option_strings:
            return text
        if "(default" in text or text.startswith("default"):
            return text
        return f"{text} (default: %(default)s)"
