"""What ``ms-deepseek plan --model ... --npus N`` prints while it searches its layouts."""


def test_a_plan_search_says_what_it_is_doing_before_it_does_it(capsys):
    """A `plan --model ... --npus N` search says on its first stderr line how many layouts it estimates, also
    through a pipe (the progress bar draws only on a terminal), before the layout it prints."""
    from bad_input_helpers import run_cli

    code, out, err = run_cli(
        capsys, ["plan", "--model", "tiny", "--npus", "4", "--seq-len", "64", "--global-batch", "8"]
    )
    assert code in (0, 1), err
    first = err.strip().splitlines()[0]
    assert first.startswith("plan: estimating ") and first.endswith(" layouts of 4 NPUs ..."), err
    assert out.startswith("layout: ")
