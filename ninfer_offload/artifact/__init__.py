"""The `.ninfer` container: reader, writer, numeric codecs, inventory accounting and the model's dimensions."""
