"""Boxes as answers (issue 50): the `Box` record, the image geometry from original pixels to what a model sees, the
per-family codecs (boxes ↔ answer text), the readers/writers of COCO, YOLO and Label Studio boxes, IoU matching,
mAP evaluation, box uncertainty and class-balanced selection, box label checks, generated scenes, the ledger's box
label, consensus across annotators and the annotation batch out and back.

A ground-floor package: it imports nothing of tamis above `pipeline.errors` and `pipeline.store`, so the model
families (which name their codec) and the stages can all stand on it. docs/boxes.md says what exists and what is next.
"""
