"""Whether a process's command line is one its unit's `ExecStart=` could have started.

The port guard kills a stale copy of a unit's own server. The same executable is not proof:
with `ExecStart=/usr/bin/python3 -m vllm.entrypoints.openai.api_server …`, a hand-started
`python3 -m http.server 8000` runs the same interpreter. So the guard also asks that the
command line fit the unit's `ExecStart=` as `systemctl show` prints it (`argv[]=`: words
joined by spaces, specifiers such as `%i` already resolved, environment variables not):

- a literal word must be the same word, in the same place;
- a word holding `${NAME}` stands for exactly one word (systemd.service(5): "always resulting
  in exactly a single argument"), the literal parts around it included;
- a word that is just `$NAME` stands for zero or more words (split at whitespace);
- `$$` is a literal `$`.

`argv[0]` is not compared (`@` in `ExecStart=` sets it freely; the executable is compared by
its resolved path elsewhere). Anything that does not fit is refused, for a person to judge:
a false "no" leaves a port taken and says so, a false "yes" kills a bystander.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache

_BRACED = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
_BARE = re.compile(r"\$[A-Za-z_][A-Za-z0-9_]*")
_ANY_WORDS = object()  # a `$NAME` word: zero or more words


@cache
def _word_pattern(word: str) -> re.Pattern[str] | object:
    if _BARE.fullmatch(word):
        return _ANY_WORDS
    parts = []
    position = 0
    for match in _BRACED.finditer(word):
        parts.append(re.escape(word[position : match.start()].replace("$$", "$")))
        parts.append(r".*")  # one word's worth, whatever it holds (spaces included)
        position = match.end()
    parts.append(re.escape(word[position:].replace("$$", "$")))
    return re.compile("".join(parts), re.S)


def fits_exec_start(cmdline: Sequence[str], argv: Sequence[str]) -> bool:
    """Whether `cmdline` (a process's argv) could come from `ExecStart=`'s `argv`.

    False when either is empty: nothing to compare is no proof.
    """
    if not cmdline or not argv:
        return False
    words = list(cmdline[1:])
    patterns = [_word_pattern(word) for word in argv[1:]]
    # fits[i][j]: patterns[i:] can match words[j:]; filled from the end.
    fits = [[False] * (len(words) + 1) for _ in range(len(patterns) + 1)]
    fits[len(patterns)][len(words)] = True
    for i in range(len(patterns) - 1, -1, -1):
        pattern = patterns[i]
        for j in range(len(words), -1, -1):
            if pattern is _ANY_WORDS:
                fits[i][j] = fits[i + 1][j] or (j < len(words) and fits[i][j + 1])
            else:
                assert isinstance(pattern, re.Pattern)
                fits[i][j] = (
                    j < len(words) and fits[i + 1][j + 1] and bool(pattern.fullmatch(words[j]))
                )
    return fits[0][0]
