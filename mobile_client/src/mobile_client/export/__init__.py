"""Static ONNX export, QDQ from our encodings, QNN (SM8850 / HTP v81) context binaries, emulator runs,
manifest. One command builds it all: ``python -m mobile_client.export.build OUT``."""
