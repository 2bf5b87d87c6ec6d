// The E2B JS SDK, unmodified, against hutch's E2B face: run by tests/e2e/test_e2b.py
// with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at a real hutchd.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { CommandExitError, Sandbox } from 'e2b';

test('the E2B JS SDK creates, runs, moves files, lists and kills through hutch', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 600_000, metadata: { from: 'js' } });
  try {
    const result = await sbx.commands.run('echo hello from js; uname -s');
    assert.equal(result.stdout, 'hello from js\nLinux\n');

    await assert.rejects(sbx.commands.run('echo no >&2; exit 7'), (err) => {
      assert.ok(err instanceof CommandExitError);
      assert.equal(err.exitCode, 7);
      assert.equal(err.stderr, 'no\n');
      return true;
    });

    await sbx.files.write('/root/js/hello.txt', 'written by js');
    assert.equal(await sbx.files.read('/root/js/hello.txt'), 'written by js');
    const entries = await sbx.files.list('/root/js');
    assert.deepEqual(entries.map((e) => e.name), ['hello.txt']);

    const bg = await sbx.commands.run('sleep 300', { background: true });
    const running = await sbx.commands.list();
    assert.ok(running.some((p) => p.pid === bg.pid));
    assert.equal(await sbx.commands.kill(bg.pid), true);

    const info = await sbx.getInfo();
    assert.equal(info.sandboxId, sbx.sandboxId);
    assert.equal(info.state, 'running');

    const paginator = Sandbox.list({ query: { metadata: { from: 'js' } } });
    const listed = await paginator.nextItems();
    assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId]);
  } finally {
    await sbx.kill();
  }
  assert.equal(await Sandbox.kill(sbx.sandboxId), false);
});
