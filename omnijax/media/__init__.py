"""Media readers: WAV audio and resampling (`audio`), images (`image`), video files into a family's units
(`video`, PyAV)."""
