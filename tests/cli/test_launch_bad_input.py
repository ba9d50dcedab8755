"""Bad input to ``ms-deepseek launch``: --master-addr values refused by name, an unresolvable master creates
nothing."""

import pytest
import yaml

from bad_input_helpers import assert_refused, listing, run_cli


def test_launch_with_an_unresolvable_master_creates_nothing(capsys, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"source": "tiny"},
                "data": {"seq_len": 16, "embedded_vocab_size": 512},
                "train": {"steps": 1, "micro_batch_size": 1},
            }
        )
    )
    before = listing(tmp_path)
    code, _, err = run_cli(
        capsys, ["launch", recipe, "--master-addr", "no-such-host.invalid", "--output", tmp_path / "runs" / "r"]
    )
    assert_refused(code, err, "--master-addr: cannot resolve 'no-such-host.invalid'")
    assert listing(tmp_path) == before


@pytest.mark.parametrize("addr", ["", "  ", "a..b", "999.1.1.1", "-x", "host_name!"])
def test_launch_master_addr(capsys, tmp_path, addr):
    code, _, err = run_cli(capsys, ["launch", "recipe.yaml", f"--master-addr={addr}"])
    assert_refused(code, err, "argument --master-addr:")


def test_launch_resume_into_a_folder_that_does_not_exist_says_so(capsys, tmp_path):
    """`launch --resume` into a run folder that does not exist is one line saying so, before any folder is made
    or any worker starts (rather than every worker reporting 'no complete checkpoint')."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"source": "tiny"},
                "data": {"seq_len": 16, "embedded_vocab_size": 512},
                "train": {"steps": 1, "micro_batch_size": 1},
            }
        )
    )
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["launch", recipe, "--output", tmp_path / "runs" / "r", "--resume"])
    assert_refused(code, err, f"--resume: the run folder {tmp_path / 'runs' / 'r'} does not exist")
    assert listing(tmp_path) == before
