"""``tests.timeline.made_during`` names the test that ran when a left-behind entry was made."""
import time

from tests.timeline import made_during, ran


def test_an_entry_is_named_with_the_test_that_made_it(tmp_path):
    with ran("maker"):
        (tmp_path / "made").write_bytes(b"x")
    time.sleep(0.05)
    (tmp_path / "later").write_bytes(b"y")
    assert made_during(str(tmp_path / "made")).endswith("during maker)")
    assert made_during(str(tmp_path / "later")).endswith("during no test (between tests))")
    assert made_during(str(tmp_path / "absent")).endswith("(gone)")
