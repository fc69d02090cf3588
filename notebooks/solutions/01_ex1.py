from grpo_nb.actors import Actor, Channel, endpoint


class Squarer(Actor):
    def __init__(self):
        self.port, self.inbox = Channel.open()

    @endpoint
    async def inlet(self):
        return self.port

    @endpoint
    async def run(self, out) -> None:
        while (x := await self.inbox.recv()) is not None:
            out.send(x * x)
        out.send(None)
