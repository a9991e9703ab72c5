# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The verdict of a verification: one `PromptCheck` per prompt, the `VerificationReport` with its table (printed by
`dar convert`, shown in the model card), and the tolerances it is judged by."""

import dataclasses
import math

import torch

# Tolerances on max |logit difference| per verification (compute) dtype (DESIGN.md section 3: SmolLM2's logits reach
# about 46, and its own fp32-vs-fp64 difference is about 6e-5). Weights stored in half precision are verified in
# float32, at the float32 bar.
DEFAULT_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-8,
    torch.float32: 2e-4,
    torch.bfloat16: 2e-4,
    torch.float16: 2e-4,
}


def check_sees_rounding(check_dtype: torch.dtype | str, storage_dtype: torch.dtype | str) -> bool:
    """Whether a check computed in `check_dtype` measures what storing the weights in `storage_dtype` rounded: only
    in a finer dtype; in one no finer, both models compute from the same rounded weights. Dtypes or their names
    ("float32", as the report holds them)."""
    check, storage = (getattr(torch, dtype) if isinstance(dtype, str) else dtype
                      for dtype in (check_dtype, storage_dtype))
    return torch.finfo(check).bits > torch.finfo(storage).bits


class VerificationError(RuntimeError):
    """The converted model does not reproduce the source within the tolerance, or a written tensor differs from the
    source's (`verify.check_written_tensors`: `report` None); nothing was written."""

    def __init__(self, message: str, report: "VerificationReport | None"):
        super().__init__(message)
        self.report = report


@dataclasses.dataclass
class PromptCheck:
    """One prompt run through source and converted model.

    `top1_checked`: positions where the source's top-1/top-2 logit margin exceeds twice the tolerance (there no
    difference within the tolerance can change the argmax); `top1_agreed`: those where both models' argmax agree
    (teacher-forced greedy agreement); `top1_agreed_anywhere`: positions of all `num_tokens` where they agree (what a
    relaxed report shows beside the decided ones: at tolerance inf no position is decided).
    `greedy_identical` is None when full continuations did not run.
    `greedy_divergence`: where the continuations first differ, (token index, the source's top-1/top-2 logit margin
    there, the models' max abs logit difference there), from an unpadded forward over the prompt and the tokens both
    chose before it; None where they do not differ or did not run.
    """

    name: str
    num_tokens: int
    max_abs_logit: float
    max_abs_logit_difference: float
    top1_checked: int
    top1_agreed: int
    greedy_identical: bool | None
    source_continuation: list[int]
    target_continuation: list[int]
    greedy_divergence: tuple[int, float, float] | None = None
    top1_agreed_anywhere: int | None = None

    def diverged_at_near_tie(self, tolerance: float) -> bool:
        """The continuations differ first at a token the source does not decide at the bar (its top-1/top-2 margin
        at most 2 x tolerance, the rule that exempts a teacher-forced position) while the logits there agree within
        it: a tie broken differently by rounding, not a difference of the models. Never under an infinite tolerance
        (a conversion that is not function-preserving: every margin is "at most" twice it)."""
        divergence = self.greedy_divergence
        return (self.greedy_identical is False and divergence is not None and math.isfinite(tolerance)
                and divergence[1] <= 2 * tolerance and divergence[2] <= tolerance)

    @classmethod
    def of(cls, name, input_ids, max_abs_logit, max_abs_logit_difference, top1, source_tokens, target_tokens,
           divergence=None):
        """One prompt's check from its figures; top1 = (checked, agreed, agreed anywhere); continuations None when
        not run."""
        return cls(
            name=name,
            num_tokens=input_ids.shape[1],
            max_abs_logit=max_abs_logit,
            max_abs_logit_difference=max_abs_logit_difference,
            top1_checked=top1[0],
            top1_agreed=top1[1],
            greedy_identical=None if source_tokens is None else source_tokens == target_tokens,
            source_continuation=source_tokens or [],
            target_continuation=target_tokens or [],
            greedy_divergence=divergence,
            top1_agreed_anywhere=top1[2],
        )


@dataclasses.dataclass
class VerificationReport:
    dtype: str  # the dtype the check computed in
    tolerance: float
    default_tolerance: float
    max_new_tokens: int  # 0 when full greedy continuations did not run
    checks: list[PromptCheck]
    method: str = "in memory"  # or "layer-streamed"
    storage_dtype: str | None = None
    first_nonfinite: str | None = None  # the first module whose output was NaN or infinite
    greedy_skipped: str = "none asked for"  # why full greedy continuations did not run
    unreached: str = ""  # a sentence on the settings no checked sequence reaches (`verify.unreached_settings`)
    rounding: str = ""  # a sentence on the source values the storage dtype rounded, where the output rounds any

    @property
    def relaxed(self) -> bool:
        """True when a caller lowered the bar above the dtype's default tolerance."""
        return self.tolerance > self.default_tolerance

    @property
    def max_abs_logit_difference(self) -> float:
        """NaN when a difference is NaN (a Python max would skip it) or nothing was compared."""
        differences = [check.max_abs_logit_difference for check in self.checks]
        return math.nan if not differences or any(map(math.isnan, differences)) else max(differences)

    @property
    def top1_checked(self) -> int:
        """Positions, over all prompts, whose next token is decided at the bar (source margin > 2 x tolerance)."""
        return sum(check.top1_checked for check in self.checks)

    @property
    def nothing_compared(self) -> str | None:
        """Why the verification compared nothing (no prompt, or no position whose next token is decided), or None.
        A relaxed check compares logits only, so it needs prompts, not decided positions (without them it passes
        unverified: `verified`)."""
        if not self.checks or not sum(check.num_tokens for check in self.checks):
            return "no prompt was run"
        if not self.relaxed and not self.top1_checked:
            return "no position's source top-1/top-2 margin exceeds 2 x tolerance, so no next token was compared"
        return None

    @property
    def greedy_ran(self) -> bool:
        return bool(self.checks) and all(check.greedy_identical is not None for check in self.checks)

    @property
    def greedy_identical(self) -> bool:
        """Full continuations identical where they ran (or first differing at a near tie: `diverged_at_near_tie`),
        and teacher-forced top-1 agreement everywhere."""
        return all(
            (check.greedy_identical is not False or check.diverged_at_near_tie(self.tie_bar))
            and check.top1_agreed == check.top1_checked
            for check in self.checks
        )

    @property
    def tie_bar(self) -> float:
        """The tolerance a greedy divergence is judged a near tie at: the check's, but never more than the dtype's
        default. A relaxed bar (10, for Drop-Upcycling's report) would call a divergence at a margin of 1 with logits
        4 apart a tie; its greedy mismatches are reported, not failed, either way."""
        return min(self.tolerance, self.default_tolerance)

    @property
    def passed(self) -> bool:
        if self.first_nonfinite is not None or self.nothing_compared is not None:
            return False
        within = self.max_abs_logit_difference <= self.tolerance  # False for NaN
        return within and (self.greedy_identical or self.relaxed)

    @property
    def verified(self) -> bool:
        """Passed, and at least one next token compared. A relaxed bar so high that no position's next token is
        decided at it (tolerance inf, or 1e30) passes with its differences reported only: NOT VERIFIED, never PASSED,
        and the model card does not claim the source's function as verified."""
        return self.passed and self.top1_checked > 0

    def checks_run(self) -> str:
        """One sentence saying which checks ran (for the table and the model card)."""
        computed = f"computed in {self.dtype}" + (
            f" from {self.storage_dtype} weights" if self.storage_dtype and self.storage_dtype != self.dtype else ""
        )
        checked = self.top1_checked
        total = sum(check.num_tokens for check in self.checks)
        greedy = (f"full greedy continuations of {self.max_new_tokens} tokens per prompt" if self.greedy_ran
                  else f"no full greedy continuations ({self.greedy_skipped})")
        if math.isinf(self.tolerance):  # nothing is decided at the bar, and no divergence is a near tie
            top1 = (f"teacher-forced top-1 agreement at all {total} positions, reported only (at tolerance inf no "
                    "position's next token is decided)")
            ties = ""
        else:
            top1 = (f"teacher-forced top-1 agreement at the {checked} of {total} positions whose source top-1/top-2 "
                    "margin exceeds 2 x tolerance")
            bar = ("tolerance" if self.tie_bar == self.tolerance else  # a relaxed bar: ties judged at the default's
                   f"the default tolerance ({self.tie_bar:.1e})")
            ties = (f" (continuations that first differ where the source's margin is within 2 x {bar} and the "
                    "logits agree within it are a near tie, not a failure)" if self.greedy_ran else "")
        return (f"Checks run ({self.method}, {computed}): max abs logit difference at every position; {top1}; "
                f"{greedy}{ties}." + (f" {self.unreached}" if self.unreached else ""))

    def table(self) -> str:
        """A Markdown table: one row per prompt, then the verdict and the checks that ran."""
        lines = [
            "| prompt | tokens | max abs logit | max abs logit difference | top-1 agreement (teacher-forced) "
            "| greedy continuation identical |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for check in self.checks:
            top1 = f"{check.top1_agreed}/{check.top1_checked}"
            if self.relaxed and check.top1_agreed_anywhere is not None:
                top1 += f" (all positions: {check.top1_agreed_anywhere}/{check.num_tokens})"
            greedy = ("not run" if check.greedy_identical is None
                      else f"{'yes' if check.greedy_identical else 'NO'} ({self.max_new_tokens} tokens)")
            if check.greedy_divergence is not None:
                index, margin, difference = check.greedy_divergence
                tie = check.diverged_at_near_tie(self.tie_bar)
                greedy = (f"{'tie' if tie else 'NO'}: first differs at new token {index + 1}, where the source's "
                          f"top-1/top-2 margin is {margin:.1e} ({'<=' if margin <= 2 * self.tie_bar else '>'} 2 x "
                          f"{'tolerance' if self.tie_bar == self.tolerance else 'the default tolerance'}) and the "
                          f"logits differ by {difference:.1e}")
            lines.append(
                f"| {check.name} | {check.num_tokens} | {check.max_abs_logit:.2f} | "
                f"{check.max_abs_logit_difference:.3e} | {top1} | {greedy} |"
            )
        verdict = "PASSED" if self.verified else "FAILED"
        if self.passed and not self.verified:
            verdict = ("NOT VERIFIED (tolerance inf: differences reported only)" if math.isinf(self.tolerance) else
                       f"NOT VERIFIED (tolerance {self.tolerance:.1e}: differences reported only; no position's source "
                       "top-1/top-2 margin exceeds 2 x tolerance, so no next token was compared)")
        bar = f"tolerance {self.tolerance:.1e} in {self.dtype}"
        if self.relaxed:
            bar += f" (RELAXED from the default {self.default_tolerance:.1e}; greedy mismatches only reported)"
        lines.append("")
        if self.first_nonfinite is not None:
            lines.append(f"FAILED: non-finite values (NaN or inf) first appear in the output of {self.first_nonfinite}.")
        elif self.nothing_compared is not None:
            lines.append(f"FAILED: nothing was compared ({self.nothing_compared}).")
        else:
            lines.append(f"{verdict}: max abs logit difference {self.max_abs_logit_difference:.3e}, {bar}.")
        if self.rounding:
            lines.append(self.rounding)
        lines.append(self.checks_run())
        return "\n".join(lines)


__all__ = ["DEFAULT_TOLERANCES", "PromptCheck", "VerificationError", "VerificationReport",
           "check_sees_rounding"]
