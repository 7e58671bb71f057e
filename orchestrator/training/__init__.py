"""Worker side: the code that runs inside each Ray Train worker. Imports torch and the public
ray.train API only."""
