"""The `.ninfer` container: reader, writer, numeric codecs and inventory accounting."""
