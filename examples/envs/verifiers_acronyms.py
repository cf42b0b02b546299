"""A user's own verifiers taskset (verifiers 0.4, https://github.com/PrimeIntellect-ai/verifiers), trained with shifu:
write the acronym of a phrase ("portable network graphics" -> "PNG"). Not arithmetic, and offline: the phrases
are made from the word list below, so nothing is downloaded.

The module is what a verifiers taskset package holds (``vf-init`` lays one out the same way): the task's data, the
task with its reward (a ``@vf.reward`` method over the finished trace), the taskset's config and the taskset,
exported through ``__all__``. verifiers imports it by its name, ``verifiers_acronyms``, from the working directory
(shifu puts it first on the import path of the verifiers process). Its config: ``num_tasks``, ``words`` (per
phrase) and ``split``: ``train`` and ``test`` draw disjoint phrases, so ``test`` is the held-out split.

Needs verifiers 0.4 and uv where verifiers runs (``pip install 'shifu-rlhf[verifiers]'``, or a virtual
environment of its own named by ``verifiers.python``; docs/how-to/verifiers.md). From this folder::

    shifu ppo --out runs/acronyms model.path=PATH/TO/POLICY verifiers.taskset=verifiers_acronyms \\
        'verifiers.kwargs={num_tasks: 512}' 'verifiers.eval_kwargs={split: test, num_tasks: 64}' \\
        verifiers.python=PATH/TO/VENV/bin/python critic.init=sft generation.max_new_tokens=8
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

WORDS = (
    "active adaptive advanced analog applied artificial automatic balanced basic binary central common compact "
    "computer control digital direct dynamic electronic external federal file flexible general global graphics "
    "hybrid image integrated interface internal language local machine modular national network neural open "
    "operating optical parallel personal portable power private program protocol public random remote secure "
    "serial service shared simple social software standard static storage system transfer unified universal "
    "virtual visual wireless"
).split()
EXAMPLE = "central processing unit: CPU"  # the prompt's worked example (its words are not all in WORDS)
SPLITS = {"train": 0, "test": 1}  # a phrase's split: the parity of its seed


def acronym(phrase: str) -> str:
    return "".join(w[0].upper() for w in phrase.split())


def score(reply: str, answer: str) -> float:
    """The fraction of the answer's letters that the reply's first word of two or more capitals gets right, in
    place ("The acronym is PNG." reads PNG); a longer guess is divided by its own length, so padding does not
    pay."""
    words = re.findall(r"\b[A-Z]{2,}\b", reply)
    guess = words[0] if words else ""
    right = sum(a == b for a, b in zip(guess, answer))
    return right / max(len(answer), len(guess))


class AcronymData(vf.TaskData):
    answer: str


class AcronymTask(vf.Task[AcronymData]):
    @vf.reward(weight=1.0)
    async def letters(self, trace: vf.Trace) -> float:
        return score(trace.last_reply or "", self.data.answer)


class AcronymConfig(vf.TasksetConfig):
    num_tasks: int = 256
    """How many phrases."""
    words: int = 3
    """Words per phrase."""
    split: str = "train"
    """train or test: disjoint phrases (test is the held-out split)."""


class AcronymTaskset(vf.Taskset[AcronymTask, AcronymConfig]):
    def load(self):
        parity = SPLITS[self.config.split]
        for i in range(self.config.num_tasks):
            seed = 2 * i + parity
            phrase = " ".join(random.Random(seed).sample(WORDS, self.config.words))
            prompt = f"Write the acronym of the phrase in capitals.\n{EXAMPLE}\n{phrase}:"
            yield AcronymTask(
                AcronymData(prompt=prompt, answer=acronym(phrase), id=str(seed)), self.config.task
            )


__all__ = ["AcronymTaskset"]
