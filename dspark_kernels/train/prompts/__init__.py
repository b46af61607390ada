"""Deterministic, offline chat prompts in three domains for training and evaluating drafters on a chat target.

Every prompt is a plain user message (rendered through the target's chat template later). They are built only from
text that every CPython 3.11 installation carries, read from the standard library's source files (never imported,
so nothing runs) and from ``pydoc_data.topics``, plus templates in this package. Nothing is downloaded.

Domains and kinds:
    code   tasks on real standard-library functions (an allow-list of pure-Python modules, ``CODE_MODULES``): write a
           function from its signature and first docstring line (``signature``), explain a 3-20 line function
           (``explain``), fix a deterministically injected bug - off-by-one, wrong operator, swapped arguments or a
           missing return (``fix``, the correct code stored as ``answer``), add type hints (``type_hints``), write a
           docstring (``docstring``), write unit tests (``unit_test``), show how to call an API (``usage``), review or
           refactor (``review``). Signatures and snippets come from ``ast`` on the source files.
    math   grade-school word problems, arithmetic, conversions, percentages, equations, ages, money, speed, areas,
           averages, ratios, ... from 53 templates (46 train, 7 held out) with random numbers chosen
           so that every answer is exact (stored as ``answer``), random names and objects, and several wordings each.
    chat   summaries, explanations, key points, quiz questions, titles and rewrites of passages (at most
           ``MAX_PASSAGE_CHARS`` characters) from ``pydoc_data.topics`` and module docstrings (``CHAT_MODULES``, with
           the Zen of Python decoded from ``this.py``'s source); plus explanations of concepts, tips for activities,
           poems, stories, emails and comparisons from the word lists in ``chat_prompts``. The interpreter's LICENSE.txt
           is not used: some installations lack it, and the output must not depend on which files happen to be
           present.

Train / held-out split, by source and never by prompt: within each family of sources (code modules; pydoc topics;
chat modules; concepts; activities; story subjects; email situations; comparison pairs) the ``ceil(10%)`` whose
``sha256("<family>:<name>")`` sorts lowest are held out (``heldout_sources``). Math holds out whole templates
(``HELDOUT_MATH_TEMPLATES``) and, in the same way, 20% of the first names. So no (domain, source) pair and no prompt
text is in both splits; train prompts that happen to equal a held-out one are dropped.

Each split is sampled from its candidates round-robin over kinds (and, within a kind, over sources), then shuffled.
All randomness comes from ``random.Random`` seeded through sha256 of the seed and the domain, split and template: the
same seed gives byte-identical files for the same Python version (standard-library sources differ between versions,
and the manifest records the version). The built-in ``hash()`` is never used.

Output (``write_prompts``)::

    <out>/<domain>/<split>.jsonl   one {"id", "domain", "kind", "source", "prompt"[, "answer"]} object per line
    <out>/manifest.json            seed, Python version, counts per domain and split, sha256 of every file

Modules: ``code_prompts``, ``math_prompts`` and ``chat_prompts`` make each domain's candidates from its templates
and word lists; ``splits`` holds the held-out rule and the seeding, de-duplication and sampling they share;
``stdlib_sources`` parses standard-library files; ``build`` samples the sets (``build_prompts``), ``store`` writes
and reads them (``write_prompts``, ``read_prompts``) and ``__main__`` is the command line.

CLI: ``python -m dspark_kernels.train.prompts --out data/prompts [--seed 0] [--domains code math chat]``.
"""

from __future__ import annotations

from .build import build_prompts
from .chat_prompts import CHAT_MODULES, MAX_PASSAGE_CHARS
from .code_prompts import CODE_MODULES
from .math_prompts import FIRST_NAMES, HELDOUT_MATH_TEMPLATES, MATH_TEMPLATES
from .splits import DOMAINS, SPLITS, heldout_sources
from .store import read_prompts, write_prompts

__all__ = ["CHAT_MODULES", "CODE_MODULES", "DOMAINS", "FIRST_NAMES", "HELDOUT_MATH_TEMPLATES", "MATH_TEMPLATES",
           "MAX_PASSAGE_CHARS", "SPLITS", "build_prompts", "heldout_sources", "read_prompts", "write_prompts"]
