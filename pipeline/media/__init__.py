"""Filming episodes: offscreen frames of a policy or the data, encoded as GIF/MP4/WebM."""
