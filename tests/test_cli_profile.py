"""Every `dbt-llm-batch` command that reads a ledger finds it as `status` does: `--database`, else the
dbt profile's DuckDB file and schema (`--project-dir`, `--profiles-dir`, `--target`, as dbt reads them)."""

from __future__ import annotations

from helpers import triage_model

from dbt_llm_batch.ops.cli import main as cli


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, out, err) of `dbt-llm-batch <argv>`; argparse's usage error is its exit code 2 too."""
    capsys.readouterr()
    try:
        rc = cli(list(argv))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_every_ledger_command_reads_the_dbt_profile_without_database(project, emulator, capsys):
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    batch_id = emulator.batches()[0]["id"]
    project.release_database()
    where = ["--project-dir", str(project.root), "--profiles-dir", str(project.root)]

    rc, out, err = run(capsys, "poll", *where)
    assert rc == 3, err  # the batch is still open: polled in the profile's file
    rc, out, err = run(capsys, "report", *where, "--out", str(project.root / "report.html"))
    assert (rc, err) == (0, "") and (project.root / "report.html").is_file()
    rc, out, err = run(capsys, "cancel", *where, "--model", "triage")
    assert rc == 0 and f"{batch_id}: cancel requested by " in out, err
    emulator.advance(batch_id, "cancelled", 0.0)
    project.dbt("run", "-s", "triage")  # harvests the cancel: the unanswered requests are held
    project.release_database()
    rc, out, err = run(capsys, "release", *where, "--model", "triage")
    assert (rc, out.strip()) == (0, "released 6 held request(s) of triage: the next run sends them"), err
    rc, out, err = run(capsys, "requeue", *where, "--model", "triage")
    assert rc == 0 and out.startswith("requeued 0 failed request(s) of triage"), err
    rc, out, err = run(capsys, "unlock", *where, "--model", "triage")
    assert (rc, out.strip()) == (0, "triage was not locked"), err

    # A profile that names no such target is a message saying so, as for status.
    rc, out, err = run(capsys, "cancel", *where, "--target", "prod", "--model", "triage")
    assert rc == 2 and "dbt-llm-batch cancel: profile 'integration_project' in" in err and "has no target 'prod'" in err
