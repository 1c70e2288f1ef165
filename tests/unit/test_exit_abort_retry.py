"""The e2e tests' retry on torch's gloo exit abort (``tests/e2e/exit_abort.py``): only that failure is retried,
at most ``EXIT_ABORT_TRIES`` times, and the output directory is put back before each retry."""

import os

from tests.e2e.exit_abort import EXIT_ABORT_TRIES, TORCH_EXIT_ABORT, run_retrying_exit_abort


def test_only_the_exit_abort_is_retried_and_the_output_directory_restored(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt").write_text("step 2")
    count = tmp_path / "count"
    # Appends to the output (as a run's log would), counts its tries, then aborts as torch does.
    abort = ["bash", "-c", f"echo x >> {out}/log; echo . >> {count}; echo '{TORCH_EXIT_ABORT}' >&2; exit 134"]
    proc = run_retrying_exit_abort(abort, out_dir=str(out))
    assert proc.returncode == 134 and len(count.read_text().split()) == EXIT_ABORT_TRIES
    assert (out / "log").read_text() == "x\n" and (out / "ckpt").read_text() == "step 2"  # one try's writes

    count.unlink()
    other = ["bash", "-c", f"echo . >> {count}; echo 'Traceback' >&2; exit 1"]
    assert run_retrying_exit_abort(other).returncode == 1 and len(count.read_text().split()) == 1

    count.unlink()
    flaky = ["bash", "-c", f"echo . >> {count}; n=$(wc -l < {count}); "
             f"if [ $n -lt 2 ]; then echo '{TORCH_EXIT_ABORT}'; exit 134; fi; echo done"]
    proc = run_retrying_exit_abort(flaky, out_dir=str(tmp_path / "absent"))
    assert proc.returncode == 0 and proc.stdout.strip() == "done" and not os.path.exists(tmp_path / "absent")
