"""Structured answers (issue 51 item 3): `data.answer_schema` names a JSON Schema whose answers are JSON objects of
enum, string and number fields. The library parts, each a pure function of the schema:

    schema.py       load_answer_schema: the file checked (an object of enum / string / number fields) → AnswerSchema
    answers.py      parse_answer / count_invalid: an answer validated against it; label files' one column per field
    metrics.py      fields_report: per-field exact match (enum, number) or token F1 (string): per_class.json's `fields`
    labelstudio.py  labeling_config: one control per field (Choices, TextArea, Number) beside one Image per picture
    uncertainty.py  per-field uncertainty (closed: entropy over the enum; open: semantic entropy) and its combination
"""
