"""Tests of deploy/: the image, the KubeRay manifests, compose and the commands they run."""
