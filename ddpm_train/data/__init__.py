"""The data a run trains on: images from folders, datasets or the built-in shapes, batched; VAE latents and caption embeddings, each encoded once and cached."""
