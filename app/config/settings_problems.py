"""Settings problems, one line each: the key, where its value came from, what is wrong, the nearest name.

pydantic's own text spans three lines per problem and ends in a web link; someone who misspelt a
key in a TOML file needs the key, the file and the name they meant. No torch here, nor anything
that imports it: a mistake is reported in a fraction of a second, before the server is imported.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import ValidationError
from pydantic_settings import SettingsError as SourceError

LONGEST_VALUE = 80  # characters of a refused value quoted in a message


class SettingsError(ValueError):
    """Settings the service cannot start with; `problems` holds one line for each."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass
class Origins:
    """Where each setting's value came from: the flags given, the environment, the config file."""

    env_prefix: str
    flags: Collection[str] = ()
    environ: Mapping[str, str] = field(default_factory=dict)
    config: Path | None = None
    file_keys: Collection[str] = ()

    def of(self, key: str) -> str:
        """'flag --port', 'environment variable FFN_PORT' or 'config file /etc/ffn.toml', by precedence."""
        if key in self.flags:
            return f"flag --{key.replace('_', '-')}"
        # pydantic-settings matches variable names whatever their case: name the one that is set.
        variable = next((name for name in self.environ if name.upper() == (self.env_prefix + key).upper()), None)
        if variable is not None:
            return f"environment variable {variable}"
        if self.config is not None and key in self.file_keys:
            return f"config file {self.config}"
        return "the settings"


def nearest(name: str, known: Collection[str], what: str) -> str:
    """'; did you mean X?' with the closest of `known`, or the list of `what` when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else f"; the {what} are {', '.join(known)}"


def validation_problems(
    error: ValidationError,
    origins: Origins,
    keys: Collection[str],
    model_keys: Collection[str],
    secret: Collection[str] = (),
) -> list[str]:
    """One line per error of `error`; `keys` and `model_keys` are the valid names, at the top level
    and in a [[models]] table; a value of a `secret` key is never quoted."""
    lines = []
    for item in error.errors(include_url=False):
        loc = item["loc"]
        if not loc:  # a check across settings (metrics_port and port): no one key to name
            lines.append(f"invalid settings: {_reason(item)}")
            continue
        top = str(loc[0])
        where = origins.of(top)
        key = _dotted(loc)
        if item["type"] == "extra_forbidden":
            valid, what = (model_keys, "keys of a [[models]] table") if len(loc) > 1 else (keys, "settings")
            lines.append(f"unknown setting {key} ({where}){nearest(str(loc[-1]), valid, what)}")
            continue
        shown = "" if top in secret or item["type"] == "missing" else f" (got {_quote(item.get('input'))})"
        lines.append(f"invalid setting {key} ({where}): {_reason(item)}{shown}")
    return lines


URL_EXAMPLE = "http://localhost:4318"


def url_problem(url: str, kind: Literal["endpoint", "base", "origin"] = "endpoint") -> str | None:
    """Why `url` is not an absolute http:// or https:// URL with a host, as a setting may name one; None if it is.

    Strict, since what passes is used as it is: printable ASCII only (urlsplit drops tabs and line
    breaks inside a URL and control characters before it, so a URL holding a newline passed it
    and reached the exporter, and the log line that names it, whole; a host beyond ASCII is
    written in punycode), no credentials (the URL is logged), a port in range. `kind`: "base", a
    URL a path is added to (OTLP's /v1/traces), so no query or fragment; "origin", a browser's
    Origin, scheme://host[:port] and nothing more.
    """
    odd = next((at for at, char in enumerate(url) if not "!" <= char <= "~"), None)
    if odd is not None:
        return f"holds {url[odd]!r} at character {odd}: a URL here is printable ASCII, without spaces"
    try:
        parsed = urlsplit(url)
        host = parsed.hostname
        parsed.port  # noqa: B018 (raises ValueError for a port that is not a number in range)
    except ValueError as exc:
        return f"is not a URL ({exc})"
    example = "https://app.example" if kind == "origin" else URL_EXAMPLE
    if parsed.scheme not in ("http", "https") or not host:
        return f"must be an absolute http:// or https:// URL with a host, such as {example}"
    if parsed.username is not None or parsed.password is not None:
        return "must not hold credentials (user:password@): the URL is logged"
    if kind == "origin" and (parsed.path or parsed.query or parsed.fragment or url.endswith(("?", "#"))):
        return f"must be an origin, scheme://host[:port] with no path (a browser sends {example}, never {example}/)"
    if kind == "base" and (parsed.query or parsed.fragment or url.endswith(("?", "#"))):
        return "must have no query or fragment: a path is added to it"
    return None


def source_problem(error: SourceError, origins: Origins) -> str:
    """A value pydantic-settings could not even decode, such as FFN_MODELS that is not JSON."""
    named = re.search(r'field "(\w+)"', str(error))
    if named is None:
        return f"invalid settings: {error}"
    key = named[1]
    cause = f": {error.__cause__}" if error.__cause__ is not None else ""
    return f"invalid setting {key} ({origins.of(key)}): a list or table here is written as JSON{cause}"


def unknown_arguments(extras: Sequence[str], flags: Collection[str]) -> list[str]:
    """One line per argument the command line does not know, with the nearest of `flags`."""
    lines = []
    value_may_follow = False
    for extra in extras:
        if extra.startswith("-"):
            flag, equals, _ = extra.partition("=")
            lines.append(f"unknown flag {flag}{nearest(flag, flags, 'flags')}")
            value_may_follow = not equals
        elif value_may_follow:  # the unknown flag's value
            value_may_follow = False
        else:
            lines.append(f"unexpected argument {extra!r}: every setting is a flag (--name value)")
    return lines


def _dotted(loc: tuple[int | str, ...]) -> str:
    """('models', 0, 'dtype') -> 'models[0].dtype'."""
    text = str(loc[0])
    for part in loc[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _reason(item: Mapping[str, Any]) -> str:
    message = str(item["msg"])
    return message.removeprefix("Value error, ")  # a validator's own ValueError text


def _quote(value: object) -> str:
    text = without_credentials(repr(value))
    return text if len(text) <= LONGEST_VALUE else text[: LONGEST_VALUE - 3] + "..."


# A URL's user information (`scheme://user:password@host`): never echoed, whatever else is wrong with the URL.
_USERINFO = re.compile(r"(?<=//)[^/?#@\s]*@")


def without_credentials(text: str) -> str:
    """`text` with the user and password of every URL in it replaced by `***` (a refused URL is shown, its secret never)."""
    return _USERINFO.sub("***@", text)
