"""A ``shifu ppo`` run around its iterations (:class:`Run`: checkpoints, evaluations, metric sinks), the state a
resumed run takes back from its checkpoint, what the loop says (empty responses, a reward service gone), and
the end of a run (``final/``, ``critic/``, ``summary.json`` and its closing line, with the reward-hacking
warning)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from shifu.config.loader import to_dict
from shifu.config.schema import PPOConfig, derived_sizes
from shifu.data.batches import PromptStream
from shifu.errors import ShifuError
from shifu.rollout import traces
from shifu.runs import jsonfile
from shifu.trainers import common
from shifu.trainers.common import finish_run
from shifu.trainers.ppo_async import TRAINED
from shifu.trainers.ppo_eval import evaluate_and_keep, final_evaluation, save_actor, save_critic
from shifu.trainers.ppo_models import PPOModels, PPOState


@dataclasses.dataclass
class Run:
    """What a PPO run keeps around its iterations: the models and their state, the config as it ran, the run
    directory, the prompt stream and PPO-ptx's (their positions go into checkpoints), the loop's counters
    (``iteration``, ``best``, ``best_iteration``, ``evals``; ``pending``: the metrics of an iteration whose
    evaluation a reward service interrupted), the metric sinks and the progress bar, the held-out prompts
    ``(ids, rows)`` and the gold judge of the evaluations, the held-out prompts of the final evaluation."""

    models: PPOModels
    state: PPOState
    cfg: PPOConfig
    out: Path
    stream: PromptStream
    ptx: Any  # PPO-ptx's batches (shifu.trainers.ppo_load.ptx_stream), or None
    loop: dict[str, Any]
    tracker: Any
    eval_prompts: tuple[list[list[int]], list[dict]]
    gold_fn: Any
    final_prompts: tuple[list[list[int]], list[dict]] = ([], [])
    bar: Any = None
    warned_empty: bool = False  # the responses were said to be empty (once a run)
    producer: Any = None  # where the iterations' batches come from (shifu.trainers.ppo_async.Producer)

    def save(self, it: int) -> None:
        """A checkpoint of iteration ``it``: weights, optimisers, PPOState, the streams' positions, the loop."""
        m, strategy = self.models, self.models.strategy
        data = {"prompts": self.stream.state(), "ptx_served": self.ptx.served if self.ptx is not None else 0}
        data |= self.producer.state()  # asynchronous PPO: the batches sampled, not trained; or the ledger
        js = {
            "ppo": self.state.state_dict(strategy),
            "data": data,
            "loop": self.loop,
            "config": to_dict(self.cfg),
        }
        strategy.save_checkpoint(self.out, it, m.optimizers, m.plain, js, self.cfg.keep_last)

    def evaluate(self, it: int) -> dict[str, float]:
        """The held-out evaluation of iteration ``it`` (:func:`shifu.trainers.ppo_eval.evaluate_and_keep`), with
        no background sampling meanwhile."""
        with self.producer.paused():
            return evaluate_and_keep(
                self.models, self.cfg, self.eval_prompts, self.gold_fn, self.loop, self.out, it
            )

    def end_iterations(self) -> None:
        """The progress bar closed and an asynchronous run's sampler thread stopped: the iterations are over."""
        self.bar.close()
        self.producer.close()

    def close(self) -> None:
        """The progress bar and the metric sinks closed."""
        self.bar.close()
        self.tracker.close()

    def service_stopped(self, e: Exception, it: int) -> ShifuError:
        """The reward service went away: the checkpoint of iteration ``it`` written, the sinks closed;
        returns the error to raise (:func:`service_stopped`)."""
        self.save(it)
        self.close()
        return service_stopped(e, it, self.out)


def restore(latest: Path, models: PPOModels, state: PPOState, ptx) -> tuple[dict[str, Any], dict[str, Any]]:
    """Resuming from the checkpoint ``latest``: the models, optimisers and ``state`` take its values, the ptx
    stream skips what it served; returns ``(the data's state: the prompt stream's position "prompts" and an
    asynchronous run's pending batches "pending" (fixed) or its ledger "ledger" (bounded), the loop's counters)``."""
    strategy = models.strategy
    js = strategy.load_checkpoint(latest, models.optimizers, models.plain)
    state.load_state_dict(js["ppo"], strategy)
    for _ in range(js["data"]["ptx_served"]):  # the ptx stream continues where it was
        next(ptx)
    loop = js["loop"]
    if strategy.is_main:
        print(f"shifu ppo: resumed from {latest} at iteration {loop['iteration']}", file=sys.stderr)
    return js["data"], loop


def open_tracker(
    cfg: PPOConfig, out: Path, strategy, resume: bool, latest: Path | None, iteration: int, dropped: int
):
    """The run's metric sinks (:func:`shifu.trainers.common.tracker`). A resumed run continues its logs from
    its checkpoint at ``iteration``: what the interrupted run logged after it (metrics, evaluation samples)
    is dropped (``--resume`` without a checkpoint yet: said, and everything is dropped). A new run logs its
    sizes (``sizes/*``) and the prompts dropped at step 0."""
    main = strategy.is_main
    if resume and latest is None and main:
        print(
            f"shifu ppo: --resume: no checkpoint in '{out}' yet; starting from the beginning", file=sys.stderr
        )
    resume_step = iteration if latest is not None else (-1 if resume else None)
    tracker = common.tracker(cfg, out, strategy, resume_step)
    if main and resume_step is not None:
        trim_samples(out / "samples.jsonl", resume_step)
        trim_trained(out / TRAINED, resume_step)
    if resume_step is not None:  # each rank its own recorded episodes
        traces.trim(out, strategy.rank, resume_step)
    if latest is None:
        sizes = {f"sizes/{k}": v for k, v in derived_sizes(cfg, strategy.world).items()}
        tracker.log(0, sizes | {"data/prompts_dropped": dropped})
    return tracker


def finish(run: Run, stop_reason) -> dict[str, Any]:
    """The end of a run whose last checkpoint is written: ``final/`` (and ``critic/``), the final evaluation
    (:func:`shifu.trainers.ppo_eval.final_evaluation`: with a gold judge), ``summary.json`` (with the rollout
    source's description, ``source``: the reports read what ran from it),
    the metric sinks closed, and the closing line (:func:`closing_line`); returns the summary."""
    models, cfg, out, loop, state = run.models, run.cfg, run.out, run.loop, run.state
    save_actor(models, cfg, out / "final")
    if models.critic is not None:
        save_critic(models, cfg, out / "critic")
    summary = {
        "iterations": loop["iteration"],
        "best": loop["best"],
        "best_iteration": loop["best_iteration"],
        "guard": stop_reason,
        "evals": loop["evals"],
        "skipped_steps": state.skipped.total,
        "kl_coef": state.kl_ctl.value,
    }
    final = final_evaluation(models, cfg, run.final_prompts, run.gold_fn, out)
    run.tracker.close()
    main, n_eval = models.strategy.is_main, len(run.eval_prompts[0])
    line = closing_line(loop, state.kl_ctl.value, out, main, cfg, n_eval, final)
    ran = {"source": models.source.description.record()}  # what made the rollouts, for the reports
    return finish_run(out, summary | final | ran, models.strategy, "ppo", line)


HACKED_DROP = 0.05  # gold below its best by more than this at the end, while the score rose: a warning


def closing_line(
    loop: dict[str, Any],
    kl_coef: float,
    out: Path,
    main: bool,
    cfg: PPOConfig,
    n_eval: int,
    final: dict[str, Any] | None = None,
) -> str:
    """The run's last line on stderr, with the last evaluation's held-out gold and how it was measured
    (``n_eval`` prompts sampled at ``eval.temperature``), or the final evaluation's gold before and after
    with the paired gain (``final``: :func:`shifu.trainers.ppo_eval.final_evaluation`); before it (rank 0), a
    warning when the held-out
    judge's gold/score ended more than ``HACKED_DROP`` below its best while the reward model's eval/score
    rose past that point: the policy learned to please the reward model, not the judge (best/ keeps the
    judge's best iteration)."""
    evals = [e for e in loop["evals"] if "gold/score" in e and "eval/score" in e]
    gold = loop["evals"][-1].get("gold/score") if loop["evals"] else None
    if main and evals:
        top, last = max(evals, key=lambda e: e["gold/score"]), evals[-1]
        if last["gold/score"] < top["gold/score"] - HACKED_DROP and last["eval/score"] > top["eval/score"]:
            print(
                f"warning: shifu ppo: reward hacking? held-out gold/score fell from {top['gold/score']:.3f} "
                f"(iteration {top['iteration']}) to {last['gold/score']:.3f} (iteration {last['iteration']}) while "
                f"the reward model's eval/score rose from {top['eval/score']:.3f} to {last['eval/score']:.3f}. "
                f"final/ is the last iteration; best/ holds iteration {loop['best_iteration']}",
                file=sys.stderr,
            )
    line = f"shifu ppo: {loop['iteration']} iterations, final KL coefficient {kl_coef:.3g}"
    if final:
        line += f", held-out gold {paired_result(final)}"
    elif gold is not None:
        how = f"last evaluation: {n_eval} prompts sampled at T={cfg.eval.temperature:g}"
        line += f", held-out gold {gold:.3f} ({how})"
    return line + f"; actor in {out / 'final'}"


def paired_result(s: dict[str, Any]) -> str:
    """A final evaluation's gold in words: before -> after, the paired gain, each ± one standard error, and
    how it was measured."""

    def pm(key: str, sign: str = "") -> str:
        se = s.get(f"{key}_se")
        return f"{s[key]:{sign}.3f}" + (f" ± {se:.3f}" if se is not None else "")

    return (
        f"{pm('gold_before')} -> {pm('gold_after')}, gain {pm('gold_gain', '+')} (paired, "
        f"{s['eval_prompts']} prompts sampled at T={s['eval_temperature']:g}; start vs final policy)"
    )


def warn_empty_responses(it: int, metrics: dict, tok, cfg: PPOConfig) -> bool:
    """Say once that the responses are (almost) all empty, and the likely reason (an untemplated prompt)."""
    template = "has a chat template" if getattr(tok, "chat_template", None) else "has no chat template"
    print(
        f"warning: shifu ppo: iteration {it}: responses are {metrics['rollout/response_len']:.2f} tokens long on "
        f"average: the policy ends (EOS) at once. An instruct model does that when a prompt is not in its chat "
        f"format: data.chat_template={str(cfg.data.chat_template).lower()} and the tokenizer {template} "
        "(rows with `messages` are always rendered); check the prompts in samples.jsonl",
        file=sys.stderr,
    )
    return True


def trim_samples(path: Path, last_iteration: int) -> None:
    """Resuming: drop the evaluation samples an interrupted run wrote after ``last_iteration``."""
    if path.exists():
        jsonfile.keep_rows(path, lambda row: row["iteration"] <= last_iteration)


def trim_trained(path: Path, last_iteration: int) -> None:
    """Resuming: drop the lines of ``trained.jsonl`` an interrupted run wrote after ``last_iteration`` (whose
    batches are ``step`` 0 .. ``last_iteration - 1``)."""
    if path.exists():
        jsonfile.keep_rows(path, lambda row: row["step"] < last_iteration)


def service_stopped(e: Exception, it: int, out: Path) -> ShifuError:
    """The error of a run whose reward service went away, after the checkpoint of iteration ``it``."""
    return ShifuError(
        f"{e}. A checkpoint of iteration {it} is in {out}: start the service again, then continue "
        f"with: shifu ppo --out {out} --resume"
    )


def show_progress(bar, metrics: dict[str, float]) -> None:
    """One iteration more on the progress bar, with its score (process rewards included), KL and beta."""
    bar.update(1)
    bar.set_postfix(
        score=f"{metrics['objective/score'] + metrics.get('objective/process_reward', 0):.3f}",
        kl=f"{metrics['objective/kl_k3']:.2f}",
        beta=f"{metrics['objective/kl_coef']:.3g}",
    )
