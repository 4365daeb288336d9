"""What every adapter raises when a trainer and a plan do not fit together."""

from __future__ import annotations

from collections.abc import Iterable

from composer_par.findings import Finding, Report


class IntegrationError(Exception):
    """A trainer set up from a plan was refused before anything was built. ``.report``
    carries every finding (CP7xx codes, and the plan's own errors where it has some)."""

    def __init__(self, trainer: str, report: Report) -> None:
        self.trainer = trainer
        self.report = report
        super().__init__(f"{trainer} cannot run this plan as set up; nothing was built\n"
                         + report.format())


def refuse_errors(trainer: str, findings: Iterable[Finding]) -> Report:
    """Raise :class:`IntegrationError` if any finding is an error; otherwise return the
    report (its warnings are the caller's to log)."""
    report = Report.of(findings)
    if not report.ok:
        raise IntegrationError(trainer, report)
    return report
