"""`tfds.testing.mock_data` with its array_record reader's batched reads repaired.

TFDS's mock sets the reader's `__getitems__` as a plain attribute, a function that expects the
reader as its first argument (as `__getitem__`, a magic method, gets it) but is called without
it (TypeError). Here the reader binds itself to whatever `__getitems__` is set, so
`sources.read` takes the real source's batched path (`ArrayRecordDataSource.__getitems__`).
"""
import contextlib
import functools

import tensorflow_datasets as tfds


class _Reader(tfds.testing.PickableDataSourceMock):
    """The mocked array_record reader: `__getitems__` is bound to it when set."""

    def __setattr__(self, name, value):
        if name == "__getitems__":
            value = functools.partial(value, self)
        super().__setattr__(name, value)


@contextlib.contextmanager
def mock_data(**kwargs):
    """`tfds.testing.mock_data(**kwargs)` whose sources read many records in one call."""
    reader_class = tfds.testing.PickableDataSourceMock()
    reader_class.return_value = _Reader()
    with tfds.testing.mock_data(mock_array_record_data_source=reader_class, **kwargs):
        yield
