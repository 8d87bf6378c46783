"""HTTP routes: thin handlers over the codecs and the batcher."""
