"""tfm.train.resume on its own: config records and the batches a resumed run skips."""
import json

from tfm.train import resume


def test_config_changes_names_each_flattened_key_that_differs():
    old = {"lr": 1.0, "model": {"d_model": 8, "rope": {"theta": 1e4}}, "gone": 1}
    new = {"lr": 1.0, "model": {"d_model": 16, "rope": {"theta": 1e4}}, "added": 2}
    assert resume.config_changes(old, new) == ["added: '(unset)' -> 2", "gone: 1 -> '(unset)'",
                                               "model.d_model: 8 -> 16"]


def test_records_compare_against_the_newest_and_write_only_changes(tmp_path):
    said = []
    assert resume.changes_since_record(str(tmp_path), {"a": 1}) == (str(tmp_path / "config.json"), [])
    resume.record_config(str(tmp_path), {"a": 1}, start=0, changes=[], say=said.append)
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1} and not said

    resume.record_config(str(tmp_path), {"a": 1}, start=3, changes=[], say=said.append)  # unchanged resume
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]

    record, changes = resume.changes_since_record(str(tmp_path), {"a": 2})
    assert (record, changes) == (str(tmp_path / "config.json"), ["a: 1 -> 2"])
    resume.record_config(str(tmp_path), {"a": 2}, start=5, changes=changes, say=said.append)
    assert json.loads((tmp_path / "config.step5.json").read_text()) == {"a": 2}
    assert said == [f"config changed since {tmp_path / 'config.json'} (new one in {tmp_path / 'config.step5.json'}):"
                    "\n  a: 1 -> 2"]
    (tmp_path / "config.step12.json").write_text(json.dumps({"a": 3}))  # the largest step is the newest
    assert resume.changes_since_record(str(tmp_path), {"a": 3}) == (str(tmp_path / "config.step12.json"), [])


def test_skip_trained_restores_the_iterator_or_skips_what_was_trained():
    said = []
    assert list(resume.skip_trained(iter([2, 3]), first=1, data_state=None, start=0, say=said.append)) == [1, 2, 3]
    assert list(resume.skip_trained(iter([2, 3, 4]), first=1, data_state=None, start=2, say=said.append)) == [3, 4]
    assert said == ["data iterator has no saved state: skipping 1 batches"]

    class Stateful:
        def __init__(self):
            self.items = [2, 3, 4]

        def __next__(self):
            if not self.items:
                raise StopIteration
            return self.items.pop(0)

        def __iter__(self):
            return self

        def set_state(self, state):
            self.items = self.items[state:]

    assert list(resume.skip_trained(Stateful(), first=1, data_state=2, start=3, say=said.append)) == [4]
    assert len(said) == 1  # a saved state is restored, nothing skipped by reading
