"""From the user's column settings and the model to the columns the workers read, checked on the driver.

``plan`` checks the settings against the DataFrame's schema and the model's inputs and outputs,
without a Spark job; ``TrainingPlan.training`` returns the frame the workers read: one flat array
column per input, target and the sample weight (an image's bytes for an image), each row's values
to check (``sparkdl.data.checks``), plus ``VALIDATION`` when rows are held out; and the rules
(``sparkdl.data.rules``) the tasks judge those values by, which also fit every column to its input's
shape (``sparkdl.data.shapes``). ``TrainingPlan.check`` judges them on the driver instead, in one job.

Validation rows: the random split (``validation_split_mask``) is a seeded hash of each row's
values, not ``F.rand``: it selects the same rows whatever the DataFrame's partitioning or row
order (so a recomputed partition, a retried task or the driver's count can never disagree with
the workers), at the price that identical rows always land on the same side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl.data import model_io, shapes
from sparkdl.data.checks import Checks
from sparkdl.data.columns import IMAGE, SCALAR, VECTOR, SourceColumn, inspect
from sparkdl.data.fields import INPUT, TARGET, WEIGHT
from sparkdl.data.model_io import Port
from sparkdl.data.rows import VALIDATION
from sparkdl.data.rules import Checked, RowRules, column_of

ColumnSpec = str | Sequence[str] | Mapping[str, str | Sequence[str]]


@dataclasses.dataclass(frozen=True)
class TrainingData:
    """A DataFrame reduced to the columns the workers read, and the rules its rows must satisfy."""

    # one column per field, the checks column (CHECKS) unless the tasks measure every check in the fields' columns,
    # and VALIDATION (boolean) when rows are held out
    frame: DataFrame
    rules: RowRules  # judged in the tasks over the statistics of the checks column, or on the driver (``checked``)
    checked: Checked | None = None  # the driver's verdict over all rows (``TrainingPlan.check``); None: the tasks'


@dataclasses.dataclass(frozen=True)
class PlannedField:
    """A field before its rows are checked: its port, its source columns and the type its values are read as."""

    role: str
    key: str
    setting: str  # how the user named it: features_col['ids'], label_col, ...
    sources: tuple[SourceColumn, ...]
    element: str  # "float", "double", "bigint" or "string"
    port: Port | None  # the model input (None for targets and the weight)
    dtype: str

    @property
    def what(self) -> str:
        names = self.sources[0].name if len(self.sources) == 1 else [s.name for s in self.sources]
        return f"Column {names!r} (`{self.setting}`)"

    def values(self) -> Column:
        parts = [s.values(self.element) for s in self.sources]
        return parts[0] if len(parts) == 1 else F.concat(*parts)

    def nested(self) -> Column:
        """Its values as ``transform`` reads them: nested arrays and images whole, the rest flat."""
        return self.sources[0].nested(self.element) if len(self.sources) == 1 else self.values()

    def known_shape(self) -> tuple[int, ...] | None:
        """One row's shape where the schema alone tells it: a number, a list of number columns, or a Vector
        whose ML attributes give its size (an array's length is not in the schema: the rows' checks find it)."""
        if len(self.sources) > 1:
            return (len(self.sources),)
        source = self.sources[0]
        if source.kind == VECTOR and source.size is not None:
            return (source.size,)
        return () if source.kind == SCALAR else None


def plan(
    df: DataFrame,
    model,
    features_col: ColumnSpec,
    label_col: ColumnSpec,
    *,
    sample_weight_col: str | None = None,
    validation_col: str | None = None,
    validation_split: float | None = None,
    seed: int = 0,
) -> TrainingPlan:
    """Checks the columns against ``df``'s schema and ``model``, on the driver and without a Spark job.

    ``features_col`` is a column, a list of number columns, or a mapping from the model's input names
    to either; ``label_col`` likewise for the model's outputs. Raises ``ValueError`` naming the
    offending setting or column and what was expected.
    """
    if validation_col is not None and validation_split is not None:
        raise ValueError(
            "`validation_col` and `validation_split` are mutually exclusive: pass one of them. "
            f"Received: validation_col={validation_col!r}, validation_split={validation_split!r}"
        )
    inputs = _inputs(df, model, features_col)
    targets = _targets(df, model, label_col)
    weight = _weight(df, sample_weight_col) if sample_weight_col is not None else None
    mask = None
    if validation_col is not None:
        mask = _boolean_column(df, validation_col)
    elif validation_split is not None:
        mask = validation_split_mask([p.values() for p in inputs + targets], validation_split, seed)
    source = (
        f"`validation_col`={validation_col!r}"
        if validation_col is not None
        else f"`validation_split`={validation_split!r}"
    )
    return TrainingPlan(df, tuple(inputs), tuple(targets), weight, mask, validation_col, source)


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
    """Columns that passed the schema checks, and how they become the training columns."""

    df: DataFrame
    inputs: tuple[PlannedField, ...]
    targets: tuple[PlannedField, ...]
    weight: PlannedField | None
    mask: Column | None  # true for the rows held out for validation
    validation_col: str | None
    validation_source: str  # how the held-out rows were chosen, as the error messages name it

    def training(self) -> TrainingData:
        """The frame the workers read, its rows checked where they are read: each task reduces the checks
        column of its partition (``sparkdl.data.row_stats``) and judges the statistics (``sparkdl.data.rules``)
        before its first step. No Spark job."""
        checks = self._checks()
        return TrainingData(self._frame(checks), self._rules(checks))

    def check(self, num_workers: int) -> TrainingData:
        """:meth:`training`, its rows checked on the driver as well, by one Spark job over all of them."""
        checks = self._checks()
        rules = self._rules(checks)
        checked = rules.judge(checks.aggregate(self.df), num_workers)
        return TrainingData(self._frame(checks), rules, checked)

    @property
    def _planned(self) -> tuple[PlannedField, ...]:
        return self.inputs + self.targets + ((self.weight,) if self.weight else ())

    def _checks(self) -> Checks:
        checks = Checks()
        for i, field in enumerate(self._planned):
            for source in field.sources:
                element = "bigint" if source.integer else field.element
                checks.add_column(source, element, column_of(field.role, i), alone=len(field.sources) == 1)
        if self.weight is not None:
            checks.add_nonnegative(self.weight.sources[0].name)
        if self.mask is not None:
            checks.add_validation(self.mask, self.validation_col)
        return checks

    def _rules(self, checks: Checks) -> RowRules:
        return RowRules(
            self._planned,
            tuple(checks.columns),
            checks.stats,
            checks.nonnegative,
            self.validation_col,
            self.mask is not None,
            self.validation_source,
        )

    def _frame(self, checks: Checks) -> DataFrame:
        columns = [p.values().alias(column_of(p.role, i)) for i, p in enumerate(self._planned)]
        checked = checks.column()
        if checked is not None:
            columns.append(checked)
        if self.mask is not None:
            columns.append(self.mask.alias(VALIDATION))
        return self.df.select(*columns)


def _inputs(df: DataFrame, model, features_col: ColumnSpec) -> list[PlannedField]:
    return input_fields(df, model_io.inputs(model), features_col)


def input_fields(df: DataFrame, ports: Sequence[Port], features_col: ColumnSpec) -> list[PlannedField]:
    """``features_col`` matched to the model's inputs ``ports``, checked against the schema (no Spark job)."""
    names = [p.name for p in ports]
    if isinstance(features_col, Mapping):
        _same_names(features_col, names, "features_col", "input")
        chosen = [(p, features_col[p.name], f"features_col[{p.name!r}]") for p in ports]
    elif len(ports) > 1:
        raise ValueError(
            f"The model has {len(ports)} inputs {names}: pass `features_col` as a mapping from input name to "
            f"column, e.g. {{{', '.join(f'{n!r}: ...' for n in names)}}}. Received: {features_col!r}"
        )
    else:
        chosen = [(ports[0], features_col, "features_col")]
    planned = []
    for port, spec, setting in chosen:
        sources = _sources(df, spec, setting)
        for source in sources:
            _check_kind(source, port, setting)
        element = (
            "string"
            if port.is_text
            else "bigint"
            if port.is_integer
            else "double"
            if port.dtype == "float64"
            else "float"
        )
        field = PlannedField(INPUT, port.name, setting, sources, element, port, port.dtype)
        known = field.known_shape()
        if known is not None:  # the schema tells its shape: checked at once
            shapes.fit_shape(field.what, known, port, nested=False)
        planned.append(field)
    return planned


def _check_kind(source: SourceColumn, port: Port, setting: str) -> None:
    """Refuses a column whose values the input cannot take as they are: nothing is parsed, rounded or formatted."""
    column = f"Column {source.name!r} (`{setting}`) holds {source.holds} ({source.type_name})"
    if port.is_text and not source.text:
        raise ValueError(
            f"{column}, but the model's input {port.describe()} takes strings. Pass a string column (or an array of "
            f"strings), or cast it to strings first (F.col({source.name!r}).cast('string'))."
        )
    if source.text and not port.is_text:
        raise ValueError(
            f"{column}, but the model's input {port.describe()} takes numbers: strings are never parsed into "
            "numbers. Give the model a string input (keras.Input(shape=(1,), dtype='string')) followed by "
            "TextVectorization, StringLookup or Hashing, or index the column first (pyspark.ml.feature.StringIndexer)."
        )
    if port.is_integer and not source.integer:
        raise ValueError(
            f"{column}, but the model's input {port.describe()} takes integers: floats are never rounded into "
            "integers. Cast the column to an integer type, or declare the input as float."
        )


def _targets(df: DataFrame, model, label_col: ColumnSpec) -> list[PlannedField]:
    ports = model_io.outputs(model)
    names = [p.name for p in ports]
    if isinstance(label_col, Mapping):
        _same_names(label_col, names, "label_col", "output")
        chosen = [(p.name, label_col[p.name], f"label_col[{p.name!r}]") for p in ports]
    elif len(ports) > 1:
        raise ValueError(
            f"The model has {len(ports)} outputs {names}: pass `label_col` as a mapping from output name to "
            f"column, e.g. {{{', '.join(f'{n!r}: ...' for n in names)}}}. Received: {label_col!r}"
        )
    else:
        chosen = [(ports[0].name, label_col, "label_col")]
    planned = []
    for key, spec, setting in chosen:
        sources = _sources(df, spec, setting)
        if any(s.kind == IMAGE for s in sources):
            raise ValueError(f"`{setting}` names an image column: expected numbers, Vectors or arrays as labels.")
        for source in sources:
            if source.text:
                raise ValueError(
                    f"Column {source.name!r} (`{setting}`) holds strings ({source.type_name}): expected numbers as "
                    "labels (a model's outputs are numbers). Index it first (pyspark.ml.feature.StringIndexer)."
                )
        integer = all(s.integer for s in sources)
        planned.append(
            PlannedField(
                TARGET, key, setting, sources, "bigint" if integer else "float", None, "int64" if integer else "float32"
            )
        )
    return planned


def _weight(df: DataFrame, name: str) -> PlannedField:
    source = inspect(df, name, "sample_weight_col")
    if source.kind != SCALAR or source.text:
        raise ValueError(
            f"Expected column {name!r} (`sample_weight_col`) to hold one number per row. Received type: {source.type_name}"
        )
    return PlannedField(WEIGHT, "", "sample_weight_col", (source,), "float", None, "float32")


def _sources(df: DataFrame, spec, setting: str) -> tuple[SourceColumn, ...]:
    if isinstance(spec, str):
        return (inspect(df, spec, setting),)
    names = list(spec) if isinstance(spec, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"Expected `{setting}` to be a column name or a non-empty list of column names. Received: {spec!r}"
        )
    sources = tuple(inspect(df, name, setting) for name in names)
    for source in sources:
        if source.kind != SCALAR:
            raise ValueError(
                f"Expected every column in the `{setting}` list to hold one number or string per row; column "
                f"{source.name!r} is {source.type_name}. Pass a vector or array column on its own instead."
            )
    if len({source.text for source in sources}) > 1:
        kinds = {source.name: source.type_name for source in sources}
        raise ValueError(
            f"Expected the columns in the `{setting}` list to be all numbers or all strings: one model input takes "
            f"one dtype. Received: {kinds}. Give the strings an input of their own (a mapping by input name)."
        )
    return sources


def _same_names(mapping: Mapping, names: list[str], setting: str, what: str) -> None:
    unknown = [key for key in mapping if key not in names]
    if unknown:
        raise ValueError(
            f"`{setting}` names {what}(s) {unknown} that the model does not have: its {what}s are {names}."
        )
    missing = [name for name in names if name not in mapping]
    if missing:
        raise ValueError(f"`{setting}` gives no column for the model's {what}(s) {missing}: its {what}s are {names}.")


def validation_split_mask(values: list[Column], fraction: float, seed: int) -> Column:
    """True for the rows a ``validation_split`` of ``fraction`` holds out: a seeded random selection.

    Each row's values (the converted input and target columns), hashed with ``seed``, give a number
    uniform in [0, 1); rows below ``fraction`` are held out. The choice depends on the row's values
    only, never on partitioning or order, so it is the same in the driver's count, in every
    (retried) task and when recomputed later; identical rows share it.
    """
    hashed = F.xxhash64(F.lit(int(seed)), *values)
    uniform = F.shiftrightunsigned(hashed, 11).cast("double") / float(1 << 53)
    return uniform < F.lit(float(fraction))


def _boolean_column(df: DataFrame, name: str) -> Column:
    if not isinstance(name, str) or name not in df.columns:
        raise ValueError(
            f"Column {name!r} given as `validation_col` is not in the DataFrame. Available columns: {df.columns}"
        )
    data_type = df.schema[name].dataType
    if not isinstance(data_type, T.BooleanType):
        raise ValueError(
            f"Expected column {name!r} (`validation_col`) to be boolean (true: hold the row out for "
            f"validation). Received type: {data_type.simpleString()}"
        )
    return F.col(name)
